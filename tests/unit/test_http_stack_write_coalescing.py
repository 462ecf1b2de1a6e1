"""``http_stack.write_coalescing``: a listener whose config names a
``wrap_writer`` has its connections write through it; others are untouched."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest
from hypercorn.asyncio import serve

from gateway.edge.write_coalescing import CoalescingWriter
from hedgerow.http_stack import write_coalescing
from hedgerow.serving import bind_tcp, internal_config

pytestmark = pytest.mark.anyio
CHUNKS = 20


async def chunked(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for index in range(CHUNKS):  # no await that yields between them
        await send({"type": "http.response.body", "body": b"%02d;" % index, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _get(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


async def test_the_configured_listener_writes_through_its_writer_and_only_it() -> None:
    write_coalescing.install()
    made: list[CoalescingWriter] = []

    def coalescing(writer: Any) -> CoalescingWriter:
        made.append(CoalescingWriter(writer))
        return made[-1]

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        ports, sockets = [], []
        for wrap_writer in (coalescing, None):
            sock = bind_tcp("127.0.0.1", 0)
            sock.listen(16)
            sockets.append(sock)  # held: hypercorn adopts its descriptor
            config = internal_config(sock)
            if wrap_writer is not None:
                config.wrap_writer = wrap_writer  # type: ignore[attr-defined]
            ports.append(sock.getsockname()[1])
            tg.start_soon(lambda c=config: serve(chunked, c, shutdown_trigger=stop.wait))
        await anyio.sleep(0.3)
        coalesced, plain = ports
        answer = await anyio.to_thread.run_sync(_get, coalesced)
        assert answer.startswith(b"HTTP/1.1 200")
        assert all(b"%02d;" % i in answer for i in range(CHUNKS))
        (writer,) = made
        # 22 frames (headers, 20 chunks, the end) left in a few writes, not 22.
        assert 1 <= writer.writes <= 3
        assert (await anyio.to_thread.run_sync(_get, plain)).startswith(b"HTTP/1.1 200")
        assert len(made) == 1  # the other listener's connection kept hypercorn's writer
        stop.set()
