"""A deliberately small ASGI toolkit shared by the three process kinds.

Hedgerow serves a handful of routes, all of which need precise control over
streaming and disconnects, so it speaks ASGI directly instead of pulling in a
framework: a ``Request`` wrapper with a bounded body reader, a route table,
JSON/error responses, and an SSE sender that notices when the client leaves.
"""

from __future__ import annotations

import logging
import math
import re
from contextlib import aclosing
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import orjson

from hedgerow.body_budget import BodyBudget
from hedgerow.decimal_text import MAX_DIGITS, parse_decimal
from hedgerow.latest import LatestValue
from hedgerow.errors import (
    BodyBudgetExhausted,
    HedgerowError,
    InvalidRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestTimeout,
    RouteNotFound,
)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

log = logging.getLogger("hedgerow.asgi")

JSON_CONTENT = (b"content-type", b"application/json")


T = TypeVar("T")


@dataclass
class Request:
    scope: Scope
    receive: Receive
    send: Send
    path_params: dict[str, str] = field(default_factory=dict)
    # The body was read (or dropped) to its end: nothing of it is left unread.
    body_done: bool = False

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    @property
    def http_version(self) -> str:
        return str(self.scope.get("http_version", "1.1"))

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.scope["headers"]:
            if key.lower() == wanted:
                return bytes(value).decode("latin-1")
        return None

    def query(self) -> dict[str, str]:
        raw = bytes(self.scope.get("query_string", b"")).decode("latin-1")
        pairs = (p.split("=", 1) for p in raw.split("&") if p)
        return {p[0]: (p[1] if len(p) > 1 else "") for p in pairs}

    async def body(self, limit: int, *, deadline_s: float | None = None,
                   budget: BodyBudget | None = None) -> bytes:
        """Read the whole body, refusing early once it exceeds ``limit`` bytes,
        or once it has taken more than ``deadline_s`` seconds to arrive (the
        server's header timer stops at the end of the headers; a client that
        trickles its body would otherwise hold the connection for ever).
        With ``budget``, the bytes buffered count against it while the body is
        read; a body that does not fit is refused at once (503)."""
        declared = self._declared_length()
        if declared is not None and declared > limit:
            await self._discard_rest(declared)
            self.body_done = True
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if budget is not None and declared is not None and not budget.fits(declared):
            await self._discard_rest(declared)
            self.body_done = True
            raise _budget_exhausted()
        due = math.inf if deadline_s is None else anyio.current_time() + deadline_s
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                message = await self._receive_by(due, deadline_s)
                if message["type"] == "http.disconnect":
                    raise anyio.get_cancelled_exc_class()()
                chunk = message.get("body", b"")
                if size + len(chunk) > limit:
                    if message.get("more_body", False):
                        await self._discard_rest(None)
                    self.body_done = True
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
                if budget is not None and not budget.try_reserve(len(chunk)):
                    if message.get("more_body", False):
                        await self._discard_rest(None)
                    self.body_done = True
                    raise _budget_exhausted()
                size += len(chunk)  # reserved, when there is a budget
                chunks.append(chunk)
                if not message.get("more_body", False):
                    self.body_done = True
                    return b"".join(chunks)
        finally:
            if budget is not None:
                budget.release(size)  # read or refused: no longer buffered here

    def _declared_length(self) -> int | None:
        """The request's ``content-length``; 400 when it is not a plain decimal.
        (h11 and h2 refuse such a request themselves; aioquic's HTTP/3 reads it
        with ``int()``, so ``+5``, `` 5`` or ``5_0`` reach the app.)"""
        raw = self.header("content-length")
        if raw is None:
            return None
        declared = parse_decimal(raw.strip(" \t"))
        if declared is None:  # the router drops the unread body (bounded) before answering
            raise InvalidRequest("content-length must be a non-negative integer of at most "
                                 f"{MAX_DIGITS} ASCII digits", param="content-length")
        return declared

    async def _receive_by(self, due: float, deadline_s: float | None) -> Message:
        with anyio.CancelScope(deadline=due):
            return await self.receive()
        # Not drained either (that is what the client is slow at): the rest is
        # abandoned, and an HTTP/1.1 connection is closed after the answer.
        self.body_done = True
        raise RequestTimeout(
            f"the request body did not arrive within {deadline_s:g} s of its headers",
            close_connection=self.http_version.startswith("1"))

    async def _discard_rest(self, declared: int | None) -> None:
        await discard_request_body(self.scope, self.receive, declared)


def _budget_exhausted() -> BodyBudgetExhausted:
    return BodyBudgetExhausted("too many request bodies are being received at once; retry "
                               "shortly", retry_after=1)


async def discard_request_body(scope: Scope, receive: Receive, declared: int | None = None) -> None:
    """Over HTTP/1.1, read and drop (the rest of) a refused request's body,
    bounded in bytes and time, before answering: closing a connection with
    unread bytes makes the kernel reset it, and the reset can destroy the
    error response before the client reads it. HTTP/2 and HTTP/3 reset just
    the stream. ``declared``: its content-length, when known."""
    if not str(scope.get("http_version", "1.1")).startswith("1") or (
            declared is not None and declared > DISCARD_MAX_BYTES):
        return
    discarded = 0
    with anyio.move_on_after(DISCARD_MAX_S):
        while discarded <= DISCARD_MAX_BYTES:
            message = await receive()
            discarded += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


# A refused HTTP/1.1 upload is drained up to this much before the 413 goes out.
DISCARD_MAX_BYTES = 16 * 1_048_576
DISCARD_MAX_S = 2.0


Handler = Callable[[Request], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    handler: Handler


class Router:
    """Exact-or-regex route table; 404 for unknown paths, 405 for wrong methods."""

    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", path)
        self._routes.append(Route(method, re.compile(f"^{regex}$"), handler))

    async def serve(
        self, scope: Scope, receive: Receive, send: Send,
        error_headers: Callable[[Request], Headers] | None = None,
    ) -> None:
        """The whole ASGI app: lifespan, routing, and every ``HedgerowError``
        rendered as its OpenAI envelope (with ``error_headers`` added)."""
        if scope["type"] == "lifespan":
            await handle_lifespan(receive, send)
            return
        request = Request(scope, receive, send)
        extra = error_headers(request) if error_headers else []
        try:
            handler, request.path_params = self.resolve(request.method, request.path)
            await handler(request)
        except HedgerowError as error:
            if not request.body_done:  # refused before reading it (bad key, 404, 415 …)
                await discard_request_body(scope, receive)
            await send_error(send, error, extra)

    def serves(self, path: str) -> bool:
        """Whether any route, of whatever method, matches ``path``."""
        return any(route.pattern.match(path) for route in self._routes)

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        allowed: list[str] = []
        for route in self._routes:
            match = route.pattern.match(path)
            if match is None:
                continue
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                return route.handler, match.groupdict()
            allowed.append(route.method)
        if allowed:
            raise MethodNotAllowed(f"method {method} is not allowed on {path}")
        raise RouteNotFound(f"no route for {method} {path}")


async def send_json(
    send: Send, status: int, payload: Any, headers: Headers | None = None
) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [JSON_CONTENT, (b"content-length", str(len(body)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_bytes(
    send: Send, status: int, body: bytes, headers: Headers | None = None,
    content_type: bytes = b"application/json",
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type),
                        (b"content-length", str(len(body)).encode())] + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_text(
    send: Send, status: int, text: str, content_type: bytes, headers: Headers | None = None
) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: HedgerowError, headers: Headers | None = None) -> None:
    await send_json(send, error.status, error.envelope(), error.headers() + (headers or []))


SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def sse_event(payload: Any) -> bytes:
    """One SSE ``data:`` event; JSON payloads never contain raw newlines."""
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_of_latest(
    latest: LatestValue[T], version: int, render: Callable[[T], Any], *,
    keepalive_s: float, still_allowed: Callable[[], bool], check_s: float = 1.0,
) -> AsyncGenerator[bytes, None]:
    """SSE for a watch stream: each newer value of ``latest`` (rendered), a
    keep-alive comment after ``keepalive_s`` of silence, and the end of the stream
    once ``still_allowed()`` turns false (checked at least every ``check_s``: a
    watcher whose identity was revoked is cut within it)."""
    quiet_since = anyio.current_time()
    while still_allowed():
        value: T | None = None
        with anyio.move_on_after(check_s):
            version, value = await latest.wait_newer(version)
        now = anyio.current_time()
        if value is not None:
            quiet_since = now
            yield sse_event(render(value))
        elif now - quiet_since >= keepalive_s:
            quiet_since = now
            yield b": keep-alive\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has gone away (body already consumed)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def stream_until_disconnect(
    request: Request, status: int, headers: Headers, chunks: AsyncGenerator[bytes, None]
) -> bool:
    """Send ``chunks`` as one streamed response; stop at once if the client leaves.

    Returns True when the stream completed, False when the client disconnected
    (the chunk iterator is then cancelled, which cancels its upstream work).
    """

    async def pump() -> None:
        await request.send({"type": "http.response.start", "status": status, "headers": headers})
        async with aclosing(chunks):
            async for chunk in chunks:
                await request.send({"type": "http.response.body", "body": chunk, "more_body": True})
        await request.send({"type": "http.response.body", "body": b""})

    return await cancel_on_disconnect(request, pump)


class DisconnectHook(Protocol):
    """The server's ``hedgerow.disconnect`` scope extension
    (``hedgerow.http_stack.disconnect_hook`` puts one in every hypercorn request):
    ``callback`` runs in the event loop the moment the client leaves (at once
    if it already has); the call returned unregisters it."""

    def on_disconnect(self, callback: Callable[[], object]) -> Callable[[], None]: ...


DISCONNECT_EXTENSION = "hedgerow.disconnect"


def disconnect_hook(scope: Scope) -> DisconnectHook | None:
    extensions = scope.get("extensions")
    hook = extensions.get(DISCONNECT_EXTENSION) if extensions else None
    return hook if hook is not None and hasattr(hook, "on_disconnect") else None


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work`` in this task; cancel it the moment the client disconnects.

    Use once the request body has been read. Returns False when the client
    left first. Cancelling the work is what stops upstream generation. An
    exception from ``work`` is re-raised as itself, not as a group.

    Under a server that offers the ``hedgerow.disconnect`` extension (the
    gateway's hypercorn, ``hedgerow.http_stack.disconnect_hook``) and once the
    body has been read to its end, no task is started: the server's callback
    cancels the work's scope. Otherwise a watcher task waits in ``receive()``
    for ``http.disconnect``, as ASGI says -- and drains a body nobody read
    (``GET …/events`` with a body): hypercorn's queue for it holds ten
    messages, and a full one stops hypercorn reading the connection (for
    HTTP/3, the whole QUIC listener), so the close would never be seen.
    """
    hook = disconnect_hook(request.scope) if request.body_done else None
    completed = False
    if hook is not None:
        with anyio.CancelScope() as scope:
            forget = hook.on_disconnect(scope.cancel)
            try:
                await work()
                completed = True
            finally:
                forget()
        return completed
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await wait_for_disconnect(request.receive)
            tg.cancel_scope.cancel()

        # Only the watcher is a new task; ``work`` runs in this one (one task
        # fewer per request), inside the group's scope so a disconnect cancels it.
        tg.start_soon(watch)
        try:
            await work()
            completed = True
        except Exception as caught:  # re-raised below, outside the group
            error = caught
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return completed


def lowercase_headers(raw: Mapping[str, str]) -> Headers:
    return [(k.lower().encode(), v.encode()) for k, v in raw.items()]


async def handle_lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
