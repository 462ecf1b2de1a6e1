"""Each connection's TLS object, handed to the application's context.

Changes: hypercorn's ``TCPServer.run`` (``hypercorn/asyncio/tcp_server.py``,
hypercorn 0.18.0), the coroutine that owns one accepted connection and inside
whose task every request task of that connection is created: before it runs,
the ``on_connection`` hook installed here is called with the connection's
``ssl.SSLObject`` (None over plain TCP), in that task's context, and the
object is put in ``CONNECTION_TLS`` for the requests of that connection.

Why: hypercorn gives an ASGI app no view of the client certificate (it does
not implement ASGI's ``tls`` extension). ``hedgerow.trust.peer`` sets its
``PEER`` context variable from the hook; child tasks copy the context when
they are created, so each request sees its own connection's peer and no
other. Upstream, the fix is the ``tls`` scope extension:
``docs/upstream/asgi-tls-extension.patch``.

If the internals moved: ``PatchError`` at install when ``TCPServer`` has no
``run``; a ``writer`` without ``get_extra_info`` would raise in the first
connection, which ``tests/unit/test_http_stack_tls_peer.py`` catches on the
pinned version.

Scope: process. One hook for the process (installing another replaces it);
a listener without client certificates sees ``getpeercert`` return None.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from hypercorn.asyncio.tcp_server import TCPServer

from hedgerow.http_stack.patch import wrap

NAME = "tls_peer"

ConnectionHook = Callable[[ssl.SSLObject | None], None]
_hook: list[ConnectionHook] = []
# The current connection's TLS object (None: plain TCP), as ASGI's ``tls``
# extension would give it; set in each connection's task.
CONNECTION_TLS: ContextVar[ssl.SSLObject | None] = ContextVar("hedgerow_connection_tls",
                                                              default=None)


def install(on_connection: ConnectionHook | None = None) -> None:
    """Set ``CONNECTION_TLS`` and call ``on_connection(ssl_object)`` at the start
    of every TCP connection's task; idempotent (a later hook replaces the earlier)."""
    if on_connection is not None:
        _hook[:] = [on_connection]

    def make(original: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def run(self: Any, *args: Any, **kwargs: Any) -> None:
            ssl_object = self.writer.get_extra_info("ssl_object")
            CONNECTION_TLS.set(ssl_object)
            for hook in _hook:
                hook(ssl_object)
            await original(self, *args, **kwargs)
        return run

    wrap(TCPServer, "run", make, patch=NAME)
