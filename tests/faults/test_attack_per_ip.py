"""One client IP floods the gateway with connections; another is still served.

The gateway is capped at 64 open connections in all and 8 per client IP,
with at most 20 new connections a second per IP (burst 40). From 127.0.0.2
(loopback holds all of 127/8) a flood opens TCP connections for 3 s, one
every 2 ms: held open and never starting TLS, or opened and dropped at once.
Meanwhile a client from 127.0.0.1 makes a new TLS connection for every
request, five a second. Asserted, while the flood runs:

- the flood's connections beyond the per-IP limits are closed by the gateway
  within CUT_BUDGET_S of opening (at accept, not by the 5 s handshake
  timer), and no more than 8 stay open;
- every request of the other client succeeds, each within SERVED_BUDGET_S.

Without the per-IP limits, the held flood alone (about 1,500 connections)
would fill the 64-connection cap and the other client's new connections would
be refused: the cap would protect the gateway, not its other clients.

QUIC connections count against the same limits: from 127.0.0.3, 30 real
QUIC handshakes at once; asserted that exactly 8 complete (the rest are
dropped before any handshake work), that the same IP's TCP connections are
then closed at accept (its share is taken, whichever protocol took it), that
a client on 127.0.0.1 is served over HTTP/3 meanwhile, and that closing the
QUIC connections gives their slots back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.floods import ConnectionFlood, connection_flood, quic_connection_flood
from tests.support.capped import start_capped_stack
from tests.support.h3client import h3_request
from tests.support.stack import Stack
from tests.support.streams import chat_body, client

pytestmark = pytest.mark.e2e

CAP = 64
PER_IP = 8
RATE_PER_IP = 20
FLOOD_S = 3.0
FLOOD_EVERY_S = 0.002
FLOOD_MAX = 1500
ATTACKER = "127.0.0.2"
CUT_BUDGET_S = 1.0
SERVED_BUDGET_S = 2.0
MIN_SERVED = 5
# The other client is well behaved: a new connection at most this often
# (5/s, well under the per-IP rate it is subject to as well).
SERVED_EVERY_S = 0.2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_capped_stack(
        tmp_path_factory.mktemp("per-ip"), CAP, "--drain-timeout-s", "1",
        "--max-connections-per-ip", str(PER_IP), "--new-connections-per-ip", str(RATE_PER_IP),
        # 127.0.0.1 and .2 share a /24: the prefix limits are not what is tested here.
        "--max-connections-per-prefix", "0", "--new-connections-per-prefix", "0",
        # Loopback is exempt by default (local proxies, health checks, load generators).
        "--connection-limits-exempt", "none")
    try:
        yield stack
    finally:
        stack.stop_all()


def _flood(port: int, flood: ConnectionFlood) -> None:
    connection_flood(port, flood, source=ATTACKER, duration_s=FLOOD_S, every_s=FLOOD_EVERY_S,
                     max_count=FLOOD_MAX, cut_wait_s=CUT_BUDGET_S)


def _served_meanwhile(stack: Stack, flood_thread: threading.Thread) -> list[float]:
    """Requests from 127.0.0.1, a new connection each, while the flood runs: latencies."""
    latencies: list[float] = []
    while flood_thread.is_alive() or len(latencies) < MIN_SERVED:
        started = time.monotonic()
        with client(stack, timeout=10) as http:
            response = http.post("/v1/chat/completions", json=chat_body(4))
        latencies.append(time.monotonic() - started)
        assert response.status_code == 200 and response.text.rstrip().endswith("[DONE]")
        time.sleep(max(0.0, SERVED_EVERY_S - latencies[-1]))
    return latencies


def _samples(stack: Stack, name: str, label: str) -> dict[str, float]:
    return {sample.labels.get(label, ""): sample.value
            for family in text_string_to_metric_families(stack.gateway_metrics())
            for sample in family.samples if sample.name == name}


def _refused(stack: Stack) -> dict[str, float]:
    return _samples(stack, "hedgerow_connections_refused_per_client_total", "limit")


def _attack(stack: Stack, hold: bool) -> tuple[ConnectionFlood, list[float]]:
    with client(stack) as warm:  # the first request loads what serving needs
        assert warm.post("/v1/chat/completions", json=chat_body(4)).status_code == 200
    flood = ConnectionFlood(hold=hold)
    thread = threading.Thread(target=_flood, args=(stack.gateway_port, flood))
    thread.start()
    try:
        latencies = _served_meanwhile(stack, thread)
    finally:
        thread.join(FLOOD_S + 10)
    assert not thread.is_alive()
    return flood, latencies


def test_held_connections_from_one_ip_are_cut_and_others_served(stack: Stack) -> None:
    before = _refused(stack)
    flood, latencies = _attack(stack, hold=True)
    assert flood.opened > 3 * CAP, flood  # enough to fill the cap many times over
    assert flood.still_open == PER_IP, flood.still_open
    assert len(flood.cut_after) == flood.opened - PER_IP
    assert max(flood.cut_after) < CUT_BUDGET_S, sorted(flood.cut_after)[-5:]
    assert max(latencies) < SERVED_BUDGET_S, sorted(latencies)
    after = _refused(stack)
    refused = {limit: after[limit] - before.get(limit, 0.0) for limit in after}
    # Held connections hit the open limit first; once the burst is spent, the rate.
    assert refused["ip_open"] + refused["ip_rate"] == flood.opened - PER_IP, refused
    assert refused["prefix_open"] == refused["prefix_rate"] == 0


def test_churned_connections_from_one_ip_hit_the_rate_and_others_served(
        stack: Stack) -> None:
    time.sleep(2 * 40 / RATE_PER_IP)  # the attacker's bucket refills after the first test
    before = _refused(stack)
    flood, latencies = _attack(stack, hold=False)
    assert max(latencies) < SERVED_BUDGET_S, sorted(latencies)
    refused = _refused(stack)["ip_rate"] - before.get("ip_rate", 0.0)
    # At most the burst (40) and 20/s for the flood's 3 s were let through.
    assert refused >= flood.opened - (2 * RATE_PER_IP + RATE_PER_IP * FLOOD_S) - 10, (
        refused, flood.opened)
    assert flood.opened > 3 * CAP


QUIC_ATTACKER = "127.0.0.3"  # a bucket of its own: the TCP floods above spent .2's
QUIC_ATTEMPTS = 30  # inside the per-IP rate's burst (40): the open limit is what bites
QUIC_HANDSHAKE_S = 3.0
H3_SERVED = 3


def _until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_quic_connections_share_the_per_ip_limits_with_tcp(stack: Stack) -> None:
    open_sources = _samples(stack, "hedgerow_connection_sources", "state")["open"]
    dropped = _samples(stack, "hedgerow_quic_refused_total", "reason")["per_client"]
    hold = quic_connection_flood(stack.gateway_port, stack.ca_cert, source=QUIC_ATTACKER,
                                 count=QUIC_ATTEMPTS, handshake_s=QUIC_HANDSHAKE_S)
    try:
        assert len(hold.established) == PER_IP, (len(hold.established), hold.sent)
        # Its share is taken: the same IP's TCP connections are closed at accept.
        tcp = ConnectionFlood(hold=True)
        connection_flood(stack.gateway_port, tcp, source=QUIC_ATTACKER, duration_s=1.0,
                         every_s=0.1, max_count=3, cut_wait_s=CUT_BUDGET_S)
        assert tcp.opened == 3 and len(tcp.cut_after) == 3, tcp
        assert max(tcp.cut_after) < CUT_BUDGET_S, tcp.cut_after
        # Another client is served over HTTP/3 (a new connection each) meanwhile.
        for _ in range(H3_SERVED):
            started = time.monotonic()
            response = asyncio.run(h3_request("127.0.0.1", stack.gateway_port,
                                              path="/healthz", cafile=stack.ca_cert,
                                              timeout_s=SERVED_BUDGET_S, ticket_wait_s=0))
            assert response.status == 200
            assert time.monotonic() - started < SERVED_BUDGET_S
    finally:
        hold.close()
    now_dropped = _samples(stack, "hedgerow_quic_refused_total", "reason")["per_client"]
    # Each of the 22 turned away was dropped (its retransmissions too).
    assert now_dropped - dropped >= QUIC_ATTEMPTS - PER_IP, (dropped, now_dropped)
    # Closed connections give their slots back.
    assert _until(lambda: _samples(stack, "hedgerow_connection_sources", "state")["open"]
                  <= open_sources, 10.0)
