"""``http_stack.eof``: a connection its client closed frees its tasks at once,
not when the keep-alive timer (75 s on internal listeners) fires."""

from __future__ import annotations

import asyncio
import socket

import anyio
import pytest

from hedgerow.http_stack import applied
from hedgerow.serving import serve_internal
from tests.support.http_stack import hello

pytestmark = pytest.mark.anyio
REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


def _one_request_then_close(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(REQUEST)
        answer = b""
        while not answer.endswith(b"hello"):
            answer += client.recv(4096)
    return answer  # closed here: the server reads EOF


async def test_a_closed_keep_alive_connection_leaves_no_task_behind() -> None:
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_internal, hello, "127.0.0.1", 0, shutdown)
        assert applied()["eof"] == ["TCPServer._read_data"]
        await anyio.to_thread.run_sync(_one_request_then_close, port)  # warm
        await anyio.sleep(0.2)
        idle = len(asyncio.all_tasks())
        for _ in range(5):
            answer = await anyio.to_thread.run_sync(_one_request_then_close, port)
            assert answer.startswith(b"HTTP/1.1 200")
        # Unpatched, each connection's timer task (and its connection task)
        # lives on for keep_alive_timeout, 75 s here.
        with anyio.fail_after(3):
            while len(asyncio.all_tasks()) > idle:
                await anyio.sleep(0.05)
        shutdown.set()
