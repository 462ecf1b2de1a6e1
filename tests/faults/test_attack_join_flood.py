"""Connection floods against the control plane's join listener (``--join-port``:
TLS without a client certificate, so anyone on the network reaches it).

The control plane runs with small join limits: 16 connections in all, 4 per
client IP, 5 new a second per IP, an 8 s TLS handshake timeout; 127.0.0.1 (the
workers here) exempt from the per-IP limits, the rest of 127/8 not. Asserted:

- one IP (127.0.0.2) holding TCP connections open without ever starting TLS,
  a new one every 10 ms, has every one of them closed by the control plane
  (refused at accept, or cut by the handshake timer), at most 4 of them held
  at any time, and meanwhile a new
  worker joins, another IP (127.0.0.3) fetches the CA from the join port, and
  the per-IP refusals are logged naming the join flags;
- many IPs together filling the join listener's total cap for longer than a
  lease: connections beyond the cap are refused at accept (logged, naming
  --join-max-connections), and the workers' heartbeats, on the internal
  listener, are untouched; at most 16 are held at any time: every worker stays registered throughout.

"Held" is seen from outside: a connection still open ADMITTED_AFTER_S (4 s)
after it was opened was admitted; one refused is closed at accept. Without
the limits each flood would have hundreds held, each for the whole
handshake timeout, and a flood that never stops would hold them for as long
as the attacker likes.
"""

from __future__ import annotations

import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

SIM = ("--backend", "sim", "--no-warm-up")
LEASE_S = 4.0
JOIN_CAP = 16
JOIN_PER_IP = 4
HANDSHAKE_TIMEOUT_S = 8.0
# A flood connection still open this long was admitted (a refused one is
# closed at accept, within milliseconds; an admitted one lives the handshake
# timeout): generous both ways for a loaded machine.
ADMITTED_AFTER_S = HANDSHAKE_TIMEOUT_S / 2
LIMITS = {
    "HEDGEROW_CONTROL_PLANE_JOIN_MAX_CONNECTIONS": str(JOIN_CAP),
    "HEDGEROW_CONTROL_PLANE_JOIN_MAX_CONNECTIONS_PER_IP": str(JOIN_PER_IP),
    "HEDGEROW_CONTROL_PLANE_JOIN_NEW_CONNECTIONS_PER_IP": "5",
    "HEDGEROW_CONTROL_PLANE_JOIN_HANDSHAKE_TIMEOUT_S": str(HANDSHAKE_TIMEOUT_S),
    "HEDGEROW_CONTROL_PLANE_CONNECTION_LIMITS_EXEMPT": "127.0.0.1/32",
}
# Generous: how long after the flood stops every connection must be closed
# (a held one lives the handshake timeout; a loaded 2-core machine is slow).
CLOSED_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in LIMITS.items():
            patch.setenv(name, value)  # the control plane reads its flags from these
        stack = Stack(tmp_path_factory.mktemp("join-flood"))
        try:
            stack.start_control_plane(lease_s=LEASE_S)
            stack.start_worker("sim-a", *SIM)
            yield stack
        finally:
            stack.stop_all()


@dataclass
class HeldFlood:
    """TCP connections to the join port, held open without a TLS byte, from
    ``sources`` in turn, until ``stop`` is set; counts what the server closed."""

    port: int
    sources: tuple[str, ...]
    every_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    opened: int = 0
    closed_by_server: int = 0
    connect_errors: int = 0
    still_open: int = 0
    most_admitted: int = 0  # the most open for ADMITTED_AFTER_S at once
    _opened_at: dict[socket.socket, float] = field(default_factory=dict)

    def run(self) -> None:
        with selectors.DefaultSelector() as selector:
            try:
                while not self.stop.is_set():
                    source = self.sources[self.opened % len(self.sources)]
                    try:
                        sock = socket.create_connection(("127.0.0.1", self.port), timeout=2,
                                                        source_address=(source, 0))
                    except OSError:  # the accept queue full, say: the flood goes on
                        self.connect_errors += 1
                        continue
                    self.opened += 1
                    self._opened_at[sock] = time.monotonic()
                    sock.setblocking(False)
                    selector.register(sock, selectors.EVENT_READ)
                    # Paced: a refusal wakes the select at once, the next open waits.
                    next_at = time.monotonic() + self.every_s
                    while (wait := next_at - time.monotonic()) > 0:
                        self._harvest(selector, wait)
                deadline = time.monotonic() + CLOSED_WITHIN_S
                while selector.get_map() and time.monotonic() < deadline:
                    self._harvest(selector, 0.2)
                self.still_open = len(selector.get_map())
            finally:
                for key in list(selector.get_map().values()):
                    key.fileobj.close()  # type: ignore[union-attr]

    def _harvest(self, selector: selectors.BaseSelector, timeout: float) -> None:
        self._count_admitted()
        for key, _ in selector.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                if sock.recv(1):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass  # reset: closed all the same
            self.closed_by_server += 1
            del self._opened_at[sock]
            selector.unregister(sock)
            sock.close()


    def _count_admitted(self) -> None:
        old = time.monotonic() - ADMITTED_AFTER_S
        admitted = sum(1 for opened in self._opened_at.values() if opened < old)
        self.most_admitted = max(self.most_admitted, admitted)


def _start(flood: HeldFlood) -> threading.Thread:
    thread = threading.Thread(target=flood.run, daemon=True)
    thread.start()
    wait_for(lambda: flood.opened >= 2 * JOIN_CAP, "the flood to start", timeout=30)
    return thread


def _finish(flood: HeldFlood, thread: threading.Thread) -> None:
    flood.stop.set()
    thread.join(CLOSED_WITHIN_S + 10)
    assert not thread.is_alive()
    assert flood.still_open == 0, flood  # every one refused or timed out, none held
    assert flood.closed_by_server == flood.opened, flood
    assert flood.most_admitted > 0, flood  # the timer's cut is what was seen, not a refusal


def test_one_ip_flooding_the_join_port_is_bounded_and_others_still_join(stack: Stack) -> None:
    flood = HeldFlood(stack.join_port, ("127.0.0.2",), every_s=0.01)
    thread = _start(flood)
    try:
        stack.start_worker("sim-b", *SIM)  # joins over the join port, from 127.0.0.1
        # Another, non-exempt IP is not held back by the flooder's limits.
        transport = httpx.HTTPTransport(local_address="127.0.0.3",
                                        verify=ssl.create_default_context(
                                            cafile=stack.cluster_ca))
        with httpx.Client(transport=transport, timeout=10) as other:
            assert other.get(f"{stack.join_url}/v1/ca").status_code == 200
        # Long enough for connections admitted early to be seen held.
        time.sleep(ADMITTED_AFTER_S + 1)
    finally:
        _finish(flood, thread)
    assert flood.opened >= 10 * JOIN_PER_IP, flood
    assert flood.most_admitted <= JOIN_PER_IP, flood  # never more held at once
    assert {"sim-a", "sim-b"} <= _registered(stack)
    log = _control_plane_log(stack)
    assert "per-client connection limits" in log and "--join-max-connections-per-ip" in log


def test_a_flood_filling_the_join_cap_leaves_heartbeats_alone(stack: Stack) -> None:
    # 40 IPs, each within its per-IP limits: only the total cap holds them.
    sources = tuple(f"127.0.0.{n}" for n in range(10, 50))
    flood = HeldFlood(stack.join_port, sources, every_s=0.05)
    thread = _start(flood)
    try:
        # Longer than a lease: a worker whose heartbeats failed would be dropped.
        deadline = time.monotonic() + 1.5 * LEASE_S
        while time.monotonic() < deadline:
            assert {"sim-a", "sim-b"} <= _registered(stack)
            time.sleep(0.5)
    finally:
        _finish(flood, thread)
    assert flood.opened >= 3 * JOIN_CAP, flood
    assert flood.most_admitted <= JOIN_CAP, flood
    assert "connection cap reached" in _control_plane_log(stack)
    assert "--join-max-connections)" in _control_plane_log(stack)
    # Once the flood is gone, the join port serves again.
    with httpx.Client(verify=ssl.create_default_context(cafile=stack.cluster_ca),
                      timeout=10) as http:
        assert http.get(f"{stack.join_url}/healthz").status_code == 200


def _registered(stack: Stack) -> set[str]:
    return {record["registration"]["worker_id"] for record in stack.workers()}


def _control_plane_log(stack: Stack) -> str:
    (proc,) = [proc for proc in stack.procs if proc.name == "control-plane"]
    return proc.log()
