"""Slow and hostile clients: bounded, timed out, and nobody else notices.

A slowloris that trickles its request headers a byte at a time, and a client
that opens TCP but never starts TLS, are both closed by the gateway within
its bounds (``gateway/edge/transport.py``: KEEP_ALIVE_TIMEOUT_S and
TLS_HANDSHAKE_TIMEOUT_S); meanwhile ordinary clients are served at once.
Oversized headers, or too many of them, get a 4xx, never a 5xx or a hang;
a client still writing its request well after the gateway refused it still
reads why (``hedgerow/http_stack/linger.py``).
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.edge.transport import KEEP_ALIVE_TIMEOUT_S, MAX_HEADER_BYTES, TLS_HANDSHAKE_TIMEOUT_S
from hedgerow.connection_cap import TLS_SHUTDOWN_TIMEOUT_S
from tests.support.stack import Stack
from tests.support.streams import MODEL, chat_body, client

pytestmark = pytest.mark.e2e

SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "2"]
SLOWLORIS_CONNECTIONS = 16
BYTE_EVERY_S = 0.3
REQUEST_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
                + b"".join(b"x-pad-%d: %s\r\n" % (i, b"y" * 20) for i in range(40)))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("slow"))
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway("--drain-timeout-s", "1")
        yield stack
    finally:
        stack.stop_all()


def _closed_by_peer(sock: socket.socket | ssl.SSLSocket) -> bool:
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except (ssl.SSLError, ConnectionError):
        return True


def _slowloris(stack: Stack, held_for: list[float]) -> None:
    """Trickle a request's headers; record how long the gateway let it hold on."""
    context = ssl.create_default_context(cafile=stack.ca_cert)
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection(("127.0.0.1", stack.gateway_port))
    with context.wrap_socket(raw, server_hostname="localhost") as tls:
        opened = time.monotonic()
        tls.settimeout(BYTE_EVERY_S)
        for byte in REQUEST_HEAD:
            try:
                tls.sendall(bytes([byte]))
            except (ssl.SSLError, ConnectionError):
                break
            if _closed_by_peer(tls):
                break
        held_for.append(time.monotonic() - opened)


def _silent_tcp(stack: Stack, held_for: list[float]) -> None:
    """Connect and never start the TLS handshake."""
    with socket.create_connection(("127.0.0.1", stack.gateway_port)) as sock:
        opened = time.monotonic()
        sock.settimeout(0.2)
        while time.monotonic() - opened < 30 and not _closed_by_peer(sock):
            pass
        held_for.append(time.monotonic() - opened)


def test_slowloris_and_silent_connections_are_closed_while_others_are_served(
        stack: Stack) -> None:
    slowloris: list[float] = []
    silent: list[float] = []
    threads = [threading.Thread(target=_slowloris, args=(stack, slowloris), daemon=True)
               for _ in range(SLOWLORIS_CONNECTIONS)]
    threads += [threading.Thread(target=_silent_tcp, args=(stack, silent), daemon=True)
                for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    with client(stack) as http:
        for _ in range(5):
            started = time.monotonic()
            response = http.post("/v1/chat/completions", json=chat_body(8))
            assert response.status_code == 200 and response.text.rstrip().endswith("[DONE]")
            assert time.monotonic() - started < 1.0
    for thread in threads:
        thread.join(30)
    # The whole head would take 40 x 20+ bytes x 0.3 s: far longer than allowed.
    assert len(slowloris) == SLOWLORIS_CONNECTIONS
    assert KEEP_ALIVE_TIMEOUT_S - 0.5 < min(slowloris) <= max(slowloris) < KEEP_ALIVE_TIMEOUT_S + 2
    assert len(silent) == 4
    assert TLS_HANDSHAKE_TIMEOUT_S - 0.5 < min(silent) <= max(silent) < TLS_HANDSHAKE_TIMEOUT_S + 2


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _post_with_headers(stack: Stack, headers: dict[str, str], http2: bool,
                       body_after_s: float = 0.0) -> int | str:
    """Post ``BODY``; its bytes leave ``body_after_s`` after the headers (a
    client on a busy machine). A refusal must reach the client however late
    it writes: a ``WriteError`` here is the gateway closing before it could."""
    content: bytes | Iterator[bytes] = json.dumps(BODY).encode()
    if body_after_s:
        content = _late(content, body_after_s)
    with client(stack, http2=http2, timeout=10) as http:
        try:
            return http.post("/v1/chat/completions", content=content,
                             headers={**headers, "content-type": "application/json"}).status_code
        except httpx.RemoteProtocolError as error:  # h2: the server may reset the connection
            return f"reset: {error}"


def _late(body: bytes, after_s: float) -> Iterator[bytes]:
    time.sleep(after_s)
    yield body


def _oversized(shape: str) -> dict[str, str]:
    if shape == "one_huge":
        return {"x-huge": "z" * (MAX_HEADER_BYTES * 5)}
    return {f"x-many-{i}": "z" * 40 for i in range(2000)}


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("shape", ["one_huge", "very_many"])
@pytest.mark.parametrize("body_after_s", [0.0, TLS_SHUTDOWN_TIMEOUT_S + 0.5],
                         ids=["body_at_once", "body_late"])
def test_oversized_headers_get_a_4xx_not_a_5xx_or_a_hang(
        stack: Stack, http2: bool, shape: str, body_after_s: float) -> None:
    """``body_late``: the client's body leaves after the gateway has refused
    its headers and past the TLS close's wait. Before the gateway lingered,
    its write failed (httpx ``WriteError``) and it never read the GOAWAY;
    under load that happened now and then with the body sent at once."""
    started = time.monotonic()
    outcome = _post_with_headers(stack, _oversized(shape), http2, body_after_s)
    assert time.monotonic() - started < 5 + body_after_s
    if http2:
        # h2 refuses a header list over its limit at the protocol level
        # (GOAWAY, ENHANCE_YOUR_CALM) or with a 4xx.
        assert (isinstance(outcome, str) and "error_code:11" in outcome) or (
            isinstance(outcome, int) and 400 <= outcome < 500), outcome
    else:
        assert outcome == 431, outcome
    # And the gateway is unharmed.
    assert _post_with_headers(stack, {}, http2) == 200
