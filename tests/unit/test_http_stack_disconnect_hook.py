"""``http_stack.disconnect_hook``: a request's app learns that its client left
through the ``hedgerow.disconnect`` scope extension, with no task of its own
waiting in ``receive()``, over a real hypercorn connection."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import anyio
import pytest

from hedgerow.asgi import Request, cancel_on_disconnect, disconnect_hook
from hedgerow.http_stack import applied
from hedgerow.http_stack.disconnect_hook import Disconnect
from hedgerow.serving import serve_internal

pytestmark = pytest.mark.anyio
REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
# A GET with a body of 30 chunks, three times what hypercorn queues for an app.
CHUNKED = (b"GET / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
           + b"".join(b"1\r\na\r\n" for _ in range(30)))


class Streaming:
    """An app that starts a response, then writes nothing until cancelled;
    ``read_body=False``: it never reads the request's body (as ``GET …/events``)."""

    def __init__(self, read_body: bool = True) -> None:
        self.read_body = read_body
        self.started = anyio.Event()
        self.ended = anyio.Event()
        self.completed: bool | None = None
        self.hooked = False
        self.tasks_made: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if self.read_body:
            await receive()  # the (empty) body, read to its end
        request = Request(scope, receive, send, body_done=self.read_body)
        self.hooked = disconnect_hook(scope) is not None
        before = set(asyncio.all_tasks())

        async def work() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            self.tasks_made = [t.get_name() for t in asyncio.all_tasks() - before]
            self.started.set()
            await anyio.sleep_forever()

        try:
            self.completed = await cancel_on_disconnect(request, work)
        finally:
            self.ended.set()


def _read_first_then_close(port: int, request: bytes = REQUEST) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(request)
        answer = b""
        while b"first" not in answer:
            answer += client.recv(4096)
    return answer


async def test_a_client_that_closes_mid_stream_cancels_the_work_without_a_watcher_task() -> None:
    app = Streaming()
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_internal, app, "127.0.0.1", 0, shutdown)
        assert applied()["disconnect_hook"] == ["TaskGroup.spawn_app", "HTTPStream.handle"]
        answer = await anyio.to_thread.run_sync(_read_first_then_close, port)
        assert answer.startswith(b"HTTP/1.1 200")
        with anyio.fail_after(3):  # unhooked and unwatched, it would wait forever
            await app.ended.wait()
        shutdown.set()
    assert app.hooked
    assert app.completed is False
    assert app.tasks_made == []  # no watcher: the hook cancelled the work's scope


async def test_a_client_that_sent_a_body_nobody_reads_is_still_noticed_when_it_leaves() -> None:
    # The hook alone would never fire: nobody drains the body, hypercorn's queue
    # for it fills at ten messages and hypercorn stops reading the connection.
    # Until the body is read, the watcher task drains it.
    app = Streaming(read_body=False)
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_internal, app, "127.0.0.1", 0, shutdown)
        answer = await anyio.to_thread.run_sync(_read_first_then_close, port, CHUNKED)
        assert answer.startswith(b"HTTP/1.1 200")
        with anyio.fail_after(3):
            await app.ended.wait()
        shutdown.set()
    assert app.completed is False
    assert app.tasks_made == ["hedgerow.asgi.cancel_on_disconnect.<locals>.watch"]


async def test_without_the_extension_a_watcher_task_still_notices() -> None:
    hung_up = anyio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await hung_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    request = Request({"type": "http", "headers": []}, receive, send)
    async with anyio.create_task_group() as tg:
        async def hang_up_soon() -> None:
            await anyio.sleep(0.05)
            hung_up.set()
        tg.start_soon(hang_up_soon)
        with anyio.fail_after(3):
            assert await cancel_on_disconnect(request, anyio.sleep_forever) is False
    with anyio.fail_after(1):
        assert await cancel_on_disconnect(request, anyio.lowlevel.checkpoint) is True


def test_a_callback_registered_after_the_disconnect_runs_at_once() -> None:
    hook = Disconnect()
    calls: list[str] = []
    forget = hook.on_disconnect(lambda: calls.append("early"))
    forget_late = hook.on_disconnect(lambda: calls.append("forgotten"))
    forget_late()
    hook.fire()
    hook.fire()  # once only
    hook.on_disconnect(lambda: calls.append("late"))
    forget()
    assert calls == ["early", "late"]


async def test_the_app_queue_s_own_put_is_still_what_spawn_app_returns() -> None:
    # The HTTP/3 guard (gateway.edge.quic_cap) reaches a stream's queue through
    # ``app_put.__self__`` to avoid blocking the UDP task on a full one.
    from hypercorn.asyncio.task_group import TaskGroup
    from hypercorn.config import Config

    from hedgerow.http_stack import disconnect_hook as hook_patch

    hook_patch.install()

    async def app(*_: Any) -> None:
        return None

    scope: dict[str, Any] = {"type": "http", "extensions": {}}
    async with TaskGroup(asyncio.get_running_loop()) as group:
        put = await group.spawn_app(app, Config(), scope, lambda _: anyio.sleep(0))  # type: ignore[arg-type]
        assert isinstance(getattr(put, "__self__", None), asyncio.Queue)
    assert isinstance(scope["extensions"][hook_patch.EXTENSION], Disconnect)
