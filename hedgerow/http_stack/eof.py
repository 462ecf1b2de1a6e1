"""A closed connection must not wait out its keep-alive timer.

Changes: hypercorn's ``TCPServer._read_data`` (``hypercorn/asyncio/tcp_server.py``,
hypercorn 0.18.0): once it returns (the reader saw EOF or an error), the
connection's keep-alive timer (``idle_task``) is stopped.

Why: when a client closes its connection, ``TCPServer`` reads EOF and tells
the protocol, but the HTTP/1.1 protocol only ends its stream; the timer task
(``_idle_timeout``) keeps running, and the connection's task group cannot
finish until it fires. Every connection a client closed held three tasks and
its buffers for the whole ``keep_alive_timeout``: 5 s on the gateway's public
port, 75 s on the internal servers. Fifty ``GET /admin/cache`` calls left 150
tasks behind for over a minute. Whatever the app is still sending for a
request already read carries on. Upstream: ``docs/upstream/eof-stops-idle-timer.patch``.

If the internals moved: ``PatchError`` at install when ``TCPServer`` has no
``_read_data`` or ``idle_task`` is not set by its ``__init__`` (checked on a
real instance by ``tests/unit/test_http_stack_eof.py``).

Scope: process (every hypercorn TCP connection; it is a bug fix).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.asyncio.tcp_server import TCPServer

from hedgerow.http_stack.patch import wrap

NAME = "eof"


def install() -> None:
    """Idempotent."""

    def make(original: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def read_data(self: Any, *args: Any, **kwargs: Any) -> None:
            await original(self, *args, **kwargs)
            await self.idle_task.stop()  # EOF: nothing left to keep alive
        return read_data

    wrap(TCPServer, "_read_data", make, patch=NAME)
