"""Tell the application its client left without a task awaiting ``receive()``.

Changes: hypercorn's asyncio ``TaskGroup.spawn_app``
(``hypercorn/asyncio/task_group.py``, hypercorn 0.18.0), which starts the
ASGI app for one request (HTTP/1.1, HTTP/2 and HTTP/3 alike, from
``HTTPStream.handle``): before the app starts, its scope gets the extension
``scope["extensions"]["hedgerow.disconnect"]``, a ``Disconnect`` (below); the
``app_put`` it returns is left as it is, the queue's own ``put`` (the HTTP/3
guard, ``gateway.edge.quic_cap``, reaches the queue through it). And
``HTTPStream.handle`` (``hypercorn/protocol/http_stream.py``): on
``StreamClosed`` -- where hypercorn queues ``http.disconnect``: the connection
closed, or an HTTP/2 stream was reset -- the request's ``Disconnect`` fires,
synchronously, before the message waits for room in the queue. Hypercorn 0.18
never tells an HTTP/3 request that its client left (its ``H3Protocol`` turns
neither a QUIC stream reset nor the connection's end into ``StreamClosed``);
the gateway's HTTP/3 handler does (``gateway.edge.quic_cap._client_left``),
and the hook fires from there too.

Why: ASGI tells an app that its client left only through ``receive()``, so an
app that writes a long stream needs a second task to sit in ``receive()``
beside the one that writes: one task per streamed request that does nothing
else (``hedgerow.asgi.cancel_on_disconnect`` had one). With the hook, the
writer registers a callback (cancelling its own scope) and no task waits.
``http.disconnect`` still reaches ``receive()`` as ASGI says. This adds a hook
rather than fixing a bug; upstream it would be a server extension ASGI does
not define yet, so no patch is prepared in ``docs/upstream/``.

If the internals moved: ``PatchError`` at install when hypercorn's asyncio
``TaskGroup`` has no ``spawn_app`` or ``HTTPStream`` no ``handle``; a stream
that stopped keeping its ``scope``, or a close that stopped arriving as
``StreamClosed``, would leave the hook unfired, which
``tests/unit/test_http_stack_disconnect_hook.py`` catches on the pinned version
(a client that closes mid-stream must cancel the app's work).

Scope: process (every request of every hypercorn listener carries the
extension; an app that does not read it is unaffected).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.asyncio.task_group import TaskGroup
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.http_stream import HTTPStream

from hedgerow.http_stack.patch import wrap

NAME = "disconnect_hook"
EXTENSION = "hedgerow.disconnect"


class Disconnect:
    """One request's "the client left": a flag and the callbacks waiting for it.

    Callbacks run synchronously in the event loop when the server learns of
    the disconnect; one registered after it already happened runs at once.
    """

    __slots__ = ("happened", "_callbacks")

    def __init__(self) -> None:
        self.happened = False
        self._callbacks: list[Callable[[], object]] = []

    def on_disconnect(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` when the client leaves; returns the unregistering call."""
        if self.happened:
            callback()
            return _nothing
        self._callbacks.append(callback)

        def forget() -> None:
            try:
                self._callbacks.remove(callback)
            except ValueError:
                pass
        return forget

    def fire(self) -> None:
        if self.happened:
            return
        self.happened = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


def _nothing() -> None:
    return None


def fire_for(stream: Any) -> None:
    """Fire the ``Disconnect`` of a hypercorn stream's request, if it has one."""
    scope = getattr(stream, "scope", None)
    extensions = scope.get("extensions") if isinstance(scope, dict) else None
    disconnect = extensions.get(EXTENSION) if extensions else None
    if isinstance(disconnect, Disconnect):
        disconnect.fire()


def install() -> None:
    """Idempotent."""

    def make_spawn(original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def spawn_app(self: Any, app: Any, config: Any, scope: Any, *args: Any,
                            **kwargs: Any) -> Any:
            scope.setdefault("extensions", {})[EXTENSION] = Disconnect()
            # The queue's own ``put``, unwrapped: the HTTP/3 guard
            # (``gateway.edge.quic_cap``) finds the queue through it.
            return await original(self, app, config, scope, *args, **kwargs)
        return spawn_app

    def make_handle(original: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def handle(self: Any, event: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(event, StreamClosed):  # where hypercorn queues http.disconnect
                fire_for(self)  # before the message waits for room in the queue
            await original(self, event, *args, **kwargs)
        return handle

    wrap(TaskGroup, "spawn_app", make_spawn, patch=NAME)
    wrap(HTTPStream, "handle", make_handle, patch=NAME)
