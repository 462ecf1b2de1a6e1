"""A connection its client closed frees its tasks at once, not after the keep-alive timer."""

from __future__ import annotations

import asyncio

import anyio
import httpx
import pytest

from hedgerow.asgi import Receive, Scope, Send
from hedgerow.serving import serve_internal

pytestmark = pytest.mark.anyio


async def hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_closed_connections_leave_no_tasks_behind() -> None:
    # The internal servers keep idle connections alive for 75 s: far longer than
    # this test waits, so tasks still alive here would be the timer's.
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_internal, hello, "127.0.0.1", 0, shutdown)
        url = f"http://127.0.0.1:{port}/"
        with anyio.fail_after(10):  # bound at once, listening once hypercorn is up
            while True:
                try:
                    async with httpx.AsyncClient() as warm:
                        assert (await warm.get(url)).text == "hello"
                    break
                except httpx.ConnectError:
                    await anyio.sleep(0.05)
        await anyio.sleep(0.3)
        idle = len(asyncio.all_tasks())
        for _ in range(20):
            async with httpx.AsyncClient() as client:  # one connection, closed after
                assert (await client.get(url)).status_code == 200
        with anyio.fail_after(3):
            while len(asyncio.all_tasks()) > idle:
                await anyio.sleep(0.05)
        shutdown.set()
