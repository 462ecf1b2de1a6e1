"""The gateway's open-connection cap (``--max-connections``) under a flood.

A gateway capped at 20 connections, one of them a client's kept-alive
connection, is sent 50 raw TCP connections: 19 are taken (and wait for their
TLS handshake), the other 31 are closed by the gateway at once — long before
the 5 s handshake timer could have closed them. The client's open connection
is still served; a new client is refused too, which is the point of a cap.
Once the idle connections are gone, new clients are served again, and
``/metrics`` (on the admin port) counts every refusal.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.transport import TLS_HANDSHAKE_TIMEOUT_S
from tests.faults.test_fault_connection_flood import _held_until_closed
from tests.support.capped import start_capped_stack
from tests.support.stack import Stack, wait_for
from tests.support.streams import chat_body, client

pytestmark = pytest.mark.e2e

CAP = 20
FLOOD = 50
# Raw connections are watched this long after the last one opened: refused
# ones must be closed by then, taken ones (5 s handshake timer) must not.
WATCH_S = TLS_HANDSHAKE_TIMEOUT_S - 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_capped_stack(tmp_path_factory.mktemp("cap"), CAP, "--drain-timeout-s", "1")
    try:
        yield stack
    finally:
        stack.stop_all()


def _metrics(stack: Stack) -> dict[str, float]:
    text = stack.gateway_metrics()  # the admin listener: no slot of the cap taken
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("hedgerow_connections")}


def _served(stack: Stack, refused: list[int]) -> bool:
    try:
        with client(stack, timeout=5) as http:
            return http.post("/v1/chat/completions", json=chat_body(4)).status_code == 200
    except httpx.TransportError:
        refused.append(1)  # still at the cap: the gateway had not seen the closes yet
        return False


def test_connections_beyond_the_cap_are_closed_at_accept(stack: Stack) -> None:
    # No connection open: the readiness probes have gone (scrapes use the admin port).
    wait_for(lambda: _metrics(stack)["hedgerow_connections_open"] == 0, "an idle gateway", 5)
    refused_before = _metrics(stack)["hedgerow_connections_refused_total"]
    with client(stack) as kept:
        assert kept.post("/v1/chat/completions", json=chat_body(4)).status_code == 200
        raw, opened = [], []
        try:
            for _ in range(FLOOD):
                raw.append(socket.create_connection(("127.0.0.1", stack.gateway_port), timeout=5))
                opened.append(time.monotonic())
            held = _held_until_closed(raw, opened, WATCH_S)
            refused = [seconds for seconds in held if seconds < math.inf]
            assert len(refused) == FLOOD - (CAP - 1), sorted(held)
            assert max(refused) < 1.0, sorted(refused)  # at accept, not by a timer
            # The connection already open is still served; a new client is not.
            response = kept.post("/v1/chat/completions", json=chat_body(4))
            assert response.status_code == 200 and response.text.rstrip().endswith("[DONE]")
            started = time.monotonic()
            with client(stack, timeout=5) as newcomer, pytest.raises(httpx.TransportError):
                newcomer.get("/healthz")
            assert time.monotonic() - started < 1.0
        finally:
            for sock in raw:
                sock.close()
    late: list[int] = []
    wait_for(lambda: _served(stack, late), "new clients served once the idle ones closed", 5)
    metrics = _metrics(stack)
    assert metrics["hedgerow_connections_limit"] == CAP
    # 31 raw connections and the newcomer (and any try made before the closes landed).
    refused_now = metrics["hedgerow_connections_refused_total"] - refused_before
    assert refused_now == FLOOD - CAP + 2 + len(late), (refused_now, late)
    assert metrics["hedgerow_connections_open"] <= 1  # a closing client, at most
