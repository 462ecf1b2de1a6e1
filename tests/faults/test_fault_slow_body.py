"""A request body trickled after complete headers: 408, and the connection goes.

The server's header timer stops once a request's headers are parsed, and the
gateway leaves hypercorn's ``read_timeout`` off (it would cut quiet SSE
streams), so the body has a deadline of its own: ``timeouts.body_ms`` from
the policy, checked in ``hedgerow.asgi.Request.body``. Clients that send
their headers and then one byte every half second get 408 with the OpenAI
error envelope about ``body_ms`` after their headers, and the gateway closes
their HTTP/1.1 connections; ordinary clients are served meanwhile at once.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import pytest

from tests.support.stack import Stack
from tests.support.streams import MODEL, chat_body, client

pytestmark = pytest.mark.e2e

SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "2"]
BODY_MS = 2000
BYTE_EVERY_S = 0.5
TRICKLERS = 6
BODY = orjson.dumps(chat_body(8))
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY))
POLICY = f"""
timeouts: {{body_ms: {BODY_MS}}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 5000, deadline_ms: 20000}}
tenants:
  - {{name: local, class: interactive}}
models:
  - {{name: {MODEL}}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("slow-body")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(root)
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway("--policy", str(policy), "--drain-timeout-s", "1")
        with client(stack) as http:  # warm: the first request pays for lazy loading
            assert http.post("/v1/chat/completions", json=chat_body(8)).status_code == 200
        yield stack
    finally:
        stack.stop_all()


@dataclass
class Trickled:
    """What one trickling client saw, in seconds after its headers went out."""

    response: bytes = b""
    answered_after: float | None = None
    closed_after: float | None = None
    bytes_sent: int = 0


def _trickle(stack: Stack, seen: Trickled) -> None:
    """Send the headers whole, then the body a byte every BYTE_EVERY_S; read
    between bytes (one thread: an SSL socket is not for two) until closed."""
    context = ssl.create_default_context(cafile=stack.ca_cert)
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection(("127.0.0.1", stack.gateway_port))
    with context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(HEAD)
        started = time.monotonic()
        tls.settimeout(BYTE_EVERY_S)
        while time.monotonic() - started < 30 and seen.closed_after is None:
            if seen.bytes_sent < len(BODY) - 1:  # never the whole body
                _send_byte(tls, seen)
            _read(tls, seen, started)


def _send_byte(tls: ssl.SSLSocket, seen: Trickled) -> None:
    try:
        tls.sendall(BODY[seen.bytes_sent:seen.bytes_sent + 1])
        seen.bytes_sent += 1
    except (ssl.SSLError, ConnectionError):
        pass  # closed: the next read says so


def _read(tls: ssl.SSLSocket, seen: Trickled, started: float) -> None:
    try:
        data = tls.recv(65536)
    except TimeoutError:
        return
    except (ssl.SSLError, ConnectionError):
        data = b""
    elapsed = time.monotonic() - started  # when it arrived, not when the wait began
    if data:
        seen.response += data
        if seen.answered_after is None:
            seen.answered_after = elapsed
    else:
        seen.closed_after = elapsed


def test_a_trickled_body_gets_408_and_its_connection_closed_while_others_are_served(
        stack: Stack) -> None:
    trickled = [Trickled() for _ in range(TRICKLERS)]
    threads = [threading.Thread(target=_trickle, args=(stack, seen), daemon=True)
               for seen in trickled]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    with client(stack) as http:
        for _ in range(5):
            started = time.monotonic()
            response = http.post("/v1/chat/completions", json=chat_body(8))
            assert response.status_code == 200 and response.text.rstrip().endswith("[DONE]")
            assert time.monotonic() - started < 1.0
    for thread in threads:
        thread.join(30)
    deadline_s = BODY_MS / 1000
    for seen in trickled:
        head, _, body = seen.response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), seen.response[:300]
        assert b"connection: close" in head.lower()
        error = orjson.loads(body)["error"]
        assert error["code"] == "request_timeout" and error["type"] and error["message"]
        # Answered at the deadline (the next half-second read sees it), long
        # before the trickle would have finished (~len(BODY) / 2 s).
        assert seen.answered_after is not None
        assert deadline_s - 0.1 < seen.answered_after < deadline_s + 1.5, seen
        assert seen.bytes_sent < len(BODY) - 1
        # ...and the connection is freed: closed by the gateway at once.
        assert seen.closed_after is not None, seen
        assert seen.closed_after - seen.answered_after < 2.0, seen


def test_a_body_that_arrives_in_time_in_pieces_is_served(stack: Stack) -> None:
    """The deadline is for the whole body, not its pace: slow but in time is fine."""
    context = ssl.create_default_context(cafile=stack.ca_cert)
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection(("127.0.0.1", stack.gateway_port))
    with context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(HEAD)
        half = len(BODY) // 2
        for piece in (BODY[:half], BODY[half:]):
            time.sleep(BODY_MS / 1000 / 3)
            tls.sendall(piece)
        tls.settimeout(10)
        head = tls.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head[:300]
