"""``http_stack.accept_loop``: hypercorn's TLS listeners accept through the
connection cap the listener's task set, closing connections over it before TLS."""

from __future__ import annotations

import socket
import ssl

import anyio
import hypercorn.asyncio.run
import pytest

from hedgerow.connection_cap import ConnectionCap, HypercornAsyncio
from hedgerow.serving import serve_internal
from tests.support.http_stack import MutualTls, hello

pytestmark = pytest.mark.anyio


def _handshake(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert tls.recv(4096).startswith(b"HTTP/1.1 200")
        return tls
    except BaseException:
        raw.close()
        raise


async def test_a_connection_over_the_cap_is_closed_before_tls_and_others_served() -> None:
    pki = MutualTls()
    context, _ = pki.client()
    cap = ConnectionCap(1)
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve_internal(
            hello, "127.0.0.1", 0, shutdown, tls=pki.server(require_client_cert=False),
            connection_cap=cap, task_status=task_status))
        assert isinstance(hypercorn.asyncio.run.asyncio, HypercornAsyncio)
        first = await anyio.to_thread.run_sync(_handshake, port, context)
        try:
            with pytest.raises((ssl.SSLError, OSError)):
                await anyio.to_thread.run_sync(_handshake, port, context)
            assert cap.refused == 1 and cap.open == 1
        finally:
            first.close()
        with anyio.fail_after(5):
            while cap.open:
                await anyio.sleep(0.02)
        (await anyio.to_thread.run_sync(_handshake, port, context)).close()
        shutdown.set()
