"""Slow request bodies fill the gateway's body budget; the gateway stays quick.

A gateway with ``--max-buffered-body-bytes 200000``. Three clients each
declare a 65 kB body, send 60 kB of it and stall: 180 kB buffered (each
declared body fitted in what was free when it began). Then,
while they hold it:

- a request declaring 30 kB (it cannot fit) gets 503 body_budget_exhausted
  with Retry-After, within REFUSED_BUDGET_S;
- an ordinary small request is still served (200);
- once the stalled clients go, the 30 kB request fits and is served, and the
  budget's gauge is back to 0.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.capped import start_capped_stack
from tests.support.stack import Stack, wait_for
from tests.support.streams import MODEL, chat_body, client

pytestmark = pytest.mark.e2e

BUDGET = 200_000
STALLED = 3
DECLARED = 65_000
SENT = 60_000
REFUSED_BUDGET_S = 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_capped_stack(tmp_path_factory.mktemp("bodies"), 64, "--drain-timeout-s", "1",
                               "--max-buffered-body-bytes", str(BUDGET))
    try:
        yield stack
    finally:
        stack.stop_all()


def _buffered(stack: Stack) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(stack.gateway_metrics()):
        for sample in family.samples:
            if sample.name == "hedgerow_request_body_bytes_buffered":
                found[sample.labels["state"]] = sample.value
            elif sample.name == "hedgerow_request_body_budget_refused_total":
                found["refused"] = sample.value
    return found


def _stall(stack: Stack) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(stack.ca_cert))
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection(("127.0.0.1", stack.gateway_port), timeout=5)
    tls = context.wrap_socket(raw, server_hostname="localhost")
    tls.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
                b"content-type: application/json\r\n"
                + f"content-length: {DECLARED}\r\n\r\n".encode() + b" " * SENT)
    return tls


def _padded(size: int) -> dict[str, object]:
    """A valid chat body of about ``size`` bytes (the padding is one long message)."""
    return {"model": MODEL, "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": "x" * (size - 200)}]}


def test_stalled_bodies_hold_the_budget_and_new_big_ones_are_refused_quickly(
        stack: Stack) -> None:
    stalled = [_stall(stack) for _ in range(STALLED)]
    try:
        wait_for(lambda: _buffered(stack).get("in_use") == STALLED * SENT,
                 "the stalled bodies buffered", 5)
        refused_before = _buffered(stack)["refused"]
        with client(stack, timeout=10) as http:
            started = time.monotonic()
            big = http.post("/v1/chat/completions", json=_padded(30_000))
            took = time.monotonic() - started
            assert big.status_code == 503, big.text
            assert big.json()["error"]["code"] == "body_budget_exhausted"
            assert big.headers["retry-after"] == "1"
            assert took < REFUSED_BUDGET_S, took
            small = http.post("/v1/chat/completions", json=chat_body(2))
            assert small.status_code == 200
        assert _buffered(stack)["refused"] == refused_before + 1
    finally:
        for sock in stalled:
            sock.close()
    wait_for(lambda: _buffered(stack).get("in_use") == 0, "the budget given back", 5)
    with client(stack, timeout=10) as http:
        assert http.post("/v1/chat/completions", json=_padded(30_000)).status_code == 200
    assert _buffered(stack)["peak"] >= STALLED * SENT
