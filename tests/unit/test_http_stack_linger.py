"""``http_stack.linger``: a client the server refuses still reads the refusal
however late it goes on writing, and a cut client cannot hold on for ever."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from hedgerow.connection_cap import TLS_SHUTDOWN_TIMEOUT_S
from hedgerow.http_stack import applied, linger
from hedgerow.serving import serve_internal
from tests.support.http_stack import MutualTls, hello

pytestmark = pytest.mark.anyio
# h11 refuses this head at once: hypercorn answers 400 and ends the connection
# from the task reading it, as it answers an oversized HTTP/2 header block
# with GOAWAY.
BAD_HEAD = b"GET / HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n"


@pytest.fixture
def pki() -> MutualTls:
    return MutualTls()


def _connect(pki: MutualTls, port: int) -> ssl.SSLSocket:
    context, _ = pki.client()
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _answer(tls: ssl.SSLSocket) -> bytes:
    answer = b""
    while chunk := tls.recv(4096):
        answer += chunk
        if b"\r\n\r\n" in answer:
            break
    return answer


def _refused_then_writes_late(pki: MutualTls, port: int) -> bytes:
    """The refused head, then more bytes in two writes past the TLS close's
    wait (an HTTP/2 client's body and END_STREAM): the second failed with
    ``SSLEOFError`` before the server lingered."""
    with _connect(pki, port) as tls:
        tls.sendall(BAD_HEAD)
        time.sleep(TLS_SHUTDOWN_TIMEOUT_S + 0.5)
        tls.sendall(b"x" * 1000)
        time.sleep(0.1)
        tls.sendall(b"y" * 1000)
        return _answer(tls)


def _held_for(pki: MutualTls, port: int, trickle_every_s: float | None) -> float:
    """Refused, then silent or trickling: how long until the server closes."""
    with _connect(pki, port) as tls:
        tls.sendall(BAD_HEAD)
        cut = time.monotonic()
        tls.settimeout(trickle_every_s or 30)
        while time.monotonic() - cut < 30:
            try:
                if trickle_every_s is not None:
                    tls.sendall(b"z")
                if tls.recv(4096) == b"":
                    break
            except TimeoutError:
                continue
            except (ssl.SSLError, OSError):
                break
        return time.monotonic() - cut


@pytest.fixture
async def port(pki: MutualTls) -> AsyncIterator[int]:
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        yield await tg.start(lambda task_status: serve_internal(
            hello, "127.0.0.1", 0, shutdown, tls=pki.server(require_client_cert=False),
            task_status=task_status))
        shutdown.set()


async def test_a_refused_client_writing_late_still_reads_the_refusal(
        pki: MutualTls, port: int) -> None:
    assert applied()["linger"] == ["TCPServer._read_data", "TCPServer.protocol_send"]
    answer = await anyio.to_thread.run_sync(_refused_then_writes_late, pki, port)
    assert answer.startswith(b"HTTP/1.1 400"), answer


async def test_a_silent_cut_client_is_closed_once_idle(
        pki: MutualTls, port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linger, "LINGER_IDLE_S", 0.5)
    held = await anyio.to_thread.run_sync(_held_for, pki, port, None)
    # Idle bound, then the TLS close's wait for a close_notify that never comes.
    assert 0.4 < held < 0.5 + TLS_SHUTDOWN_TIMEOUT_S + 1.0, held


async def test_a_cut_client_that_keeps_writing_is_closed_at_the_limit(
        pki: MutualTls, port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linger, "LINGER_IDLE_S", 0.5)
    monkeypatch.setattr(linger, "LINGER_MAX_S", 1.5)
    held = await anyio.to_thread.run_sync(_held_for, pki, port, 0.1)
    assert 1.4 < held < 1.5 + TLS_SHUTDOWN_TIMEOUT_S + 1.0, held
