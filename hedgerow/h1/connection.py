"""One HTTP/1.1 connection: llhttp parses, an ASGI app answers each request.

``H1Connection`` is an ``asyncio.Protocol`` on a (TLS) transport. Requests
are answered one at a time in order; a pipelined request's head is parsed
and queued, reading pauses, and it starts when the one before it has ended.
Each request runs the ASGI app in one task (the only task this module
starts); ``receive`` and ``send`` are plain coroutines on the request, with
no queue between them and the connection.

Framing of responses: an app's ``content-length`` is kept (and a body that
does not match it ends the connection); a body given whole in its first
message gets a ``content-length``; a streamed body is chunked (HTTP/1.0:
close-delimited). The head is written with the first body bytes, so the
first token of a stream leaves in the same TLS record as its head. A write
never awaits unless the transport asked to pause (its buffer over the high
water mark): then ``send`` waits for ``resume_writing``.

What the connection refuses (and closes after, lingering so the client
reads the answer): a malformed head (400), a head over ``max_header_bytes``
(431), an HTTP/1.1 request without ``host`` (400). A head not complete
within ``keep_alive_timeout_s`` of the connection's start or of its last
response closes the connection without an answer (the slowloris bound the
hypercorn path has too).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools

from hedgerow.http_stack.disconnect_hook import EXTENSION as DISCONNECT_EXTENSION
from hedgerow.http_stack.disconnect_hook import Disconnect

log = logging.getLogger("hedgerow.h1")

# After an error answer, the client's further bytes are read and dropped
# until it has been quiet this long, or this long in all (as the hypercorn
# path's ``hedgerow.http_stack.linger``, nginx's lingering_close).
LINGER_IDLE_S = 2.0
LINGER_MAX_S = 10.0
# After an answer the app gave before the upload ended (a 413, a 401, the 408
# of a body that trickles): long enough for a client still pushing its upload
# to read the answer rather than a reset, short enough that a trickler's
# connection is freed at once (its slow bytes must not keep it open).
EARLY_ANSWER_LINGER_S = 1.0
BODY_HIGH_WATER = 64 * 1024  # request body buffered before reading pauses

_STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())
                 for status in HTTPStatus}
_NO_BODY_STATUSES = frozenset({204, 304}) | frozenset(range(100, 200))
# RFC 9110 5.1 / 5.5: a field name is a token; a value has no control bytes but tab.
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
# Pipelined requests parsed ahead of the one being answered; past it the
# connection stops reading, answers those, and closes (the client retries the rest).
MAX_PIPELINED = 16
# Bytes of chunk framing allowed per chunk (a size line and its CRLFs), beyond
# ``max_header_bytes`` for chunk extensions and trailers together.
CHUNK_FRAMING_BYTES = 32


@dataclass(frozen=True)
class H1Settings:
    """What one listener's HTTP/1.1 connections serve, and their bounds."""

    app: Any  # an ASGI 3 application
    keep_alive_timeout_s: float = 5.0
    max_header_bytes: int = 16 * 1024
    max_requests: int = 10_000
    graceful_timeout_s: float = 5.0
    # Added to every response head, e.g. ``(b"alt-svc", b'h3=":8443"; ma=3600')``.
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()


# Set by ``gateway.edge.transport`` for a listener that serves HTTP/1.1 natively.
ACTIVE_H1: ContextVar[H1Settings | None] = ContextVar("hedgerow_h1", default=None)


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class _PipelineFull(Exception):
    """Stops llhttp mid-buffer: enough pipelined requests are waiting."""


class _DateHeader:
    """``date: ...`` formatted once a second, not once a response."""

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._line


_DATE = _DateHeader()


class _Request:
    """One request: its scope, the body not yet received, its response's state."""

    __slots__ = ("conn", "scope", "body", "buffered", "complete", "final_given", "waiter",
                 "disconnect", "keep_alive", "is_head", "chunked", "started", "status",
                 "headers", "head_written", "ended", "expect_continue", "declared_length",
                 "sent_length", "http_10", "dropped")

    def __init__(self, conn: H1Connection, scope: dict[str, Any], keep_alive: bool,
                 expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.body: list[bytes] = []
        self.buffered = 0
        self.complete = False  # the whole body has been parsed
        self.final_given = False  # receive() returned more_body False
        self.waiter: asyncio.Future[None] | None = None
        self.disconnect: Disconnect = scope["extensions"][DISCONNECT_EXTENSION]
        self.keep_alive = keep_alive
        self.is_head = scope["method"] == "HEAD"
        self.http_10 = scope["http_version"] == "1.0"
        self.expect_continue = expect_continue
        self.chunked = False
        self.started = False
        self.status = 0
        self.headers: Any = ()
        self.head_written = False
        self.ended = False
        self.declared_length: int | None = None
        self.sent_length = 0
        self.dropped = False  # the connection refused the request: what the app sends is dropped

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- ASGI -------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.expect_continue and not self.complete and not conn.lost:
            self.expect_continue = False
            if not self.started and not self.dropped:
                conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while not self.body and not self.complete and not self.disconnect.happened:
            self.waiter = conn.loop.create_future()
            await self.waiter
        if self.body:
            data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
            self.body.clear()
            self.buffered = 0
            conn.body_taken(self)
            self.final_given = self.complete
            return {"type": "http.request", "body": data, "more_body": not self.complete}
        if self.complete and not self.final_given and not self.disconnect.happened:
            self.final_given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        # The body is all given: the next message is the client leaving (or
        # the response ending, after which nothing more will come).
        while not self.disconnect.happened and not self.ended:
            self.waiter = conn.loop.create_future()
            await self.waiter
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if self.dropped:
            return  # the connection already answered (a 400) and is closing
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = int(message["status"])
            self.headers = message.get("headers") or ()
            return
        if kind != "http.response.body":
            return  # extensions this server does not offer (trailers, push) are ignored
        if not self.started or self.ended:
            raise RuntimeError("http.response.body before http.response.start or after the end")
        body = message.get("body", b"")
        more = bool(message.get("more_body", False))
        conn = self.conn
        if conn.lost:
            if not more:
                self.ended = True
            return  # the client left; the app learns it through its disconnect
        parts: list[bytes] = []
        if not self.head_written:
            parts.append(self._head(len(body), more))
            self.head_written = True
        if body and not self.is_head and self.status not in _NO_BODY_STATUSES:
            self.sent_length += len(body)
            if self.declared_length is not None and self.sent_length > self.declared_length:
                raise RuntimeError(f"the body is longer than its content-length "
                                   f"({self.declared_length})")
            if self.chunked:
                parts.append(b"%x\r\n" % len(body))
                parts.append(body)
                parts.append(b"\r\n")
            else:
                parts.append(body)
        if not more:
            self.ended = True
            if self.chunked and not self.is_head:
                parts.append(b"0\r\n\r\n")
            if (self.declared_length is not None and not self.is_head
                    and self.sent_length != self.declared_length):
                self.keep_alive = False  # the client cannot tell where the next answer starts
        conn.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))
        if self.ended:
            self.wake()
            conn.response_ended(self)
        elif conn.write_paused:
            await conn.writable()

    def _head(self, first_length: int, more: bool) -> bytes:
        status = self.status
        if not 200 <= status <= 999:
            raise ValueError(f"not a final status: {status}")
        lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        close = not self.keep_alive
        for name, value in self.headers:
            if _FIELD_NAME.match(name) is None or _FIELD_VALUE.match(value) is None:
                raise ValueError(f"a response header is not a valid field: {name!r}")
            lowered = name.lower()
            if lowered == b"content-length":
                if not value.isdigit():
                    raise ValueError(f"content-length is not a number: {value!r}")
                self.declared_length = int(value)
            elif lowered == b"transfer-encoding":
                continue  # this server frames the body itself
            elif lowered == b"connection":
                close = close or b"close" in value.lower()
                continue
            lines.append(name + b": " + value + b"\r\n")
        if self.declared_length is None and status not in _NO_BODY_STATUSES:
            if not more:
                self.declared_length = first_length
                lines.append(b"content-length: %d\r\n" % first_length)
            elif self.http_10:
                close = True  # HTTP/1.0 has no chunks: the body ends with the connection
            else:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(_DATE.line())
        for name, value in self.conn.settings.extra_headers:
            lines.append(name + b": " + value + b"\r\n")
        if close:
            self.keep_alive = False
            lines.append(b"connection: close\r\n")
        elif self.http_10:
            lines.append(b"connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)


class H1Connection(asyncio.Protocol):
    """An HTTP/1.1 server connection (see the module docstring)."""

    def __init__(self, settings: H1Settings, loop: asyncio.AbstractEventLoop,
                 on_lost: Callable[[], None] | None = None,
                 on_closed: Callable[[H1Connection], None] | None = None) -> None:
        self.settings = settings
        self.loop = loop
        self._on_lost = on_lost
        self._on_closed = on_closed
        self._context = contextvars.copy_context()
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.draining = False
        self.write_paused = False
        self._writable: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._current: _Request | None = None  # the request being answered
        self._parsing: _Request | None = None  # the request whose body is being parsed
        self._queued: deque[_Request] = deque()  # pipelined, waiting their turn
        self._requests = 0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_until = 0.0
        self._linger_idle_s = LINGER_IDLE_S
        self._stop_parsing = False
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        # Bytes received since the current head began (llhttp buffers a header
        # it has not seen the end of, so the callbacks alone cannot bound it).
        self._in_head = True
        self._raw_head_bytes = 0
        # Bytes of a message after its head that were not body (chunk sizes,
        # extensions, trailers), against a budget: llhttp keeps no limit of its own.
        self._framing_bytes = 0
        self._chunks = 0
        self._body_seen = 0
        self._eof = False
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None
        self._scheme = "http"

    # -- asyncio.Protocol --------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self._client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self._server = (str(local[0]), int(local[1])) if isinstance(local, tuple) else None
        if transport.get_extra_info("ssl_object") is not None:
            self._scheme = "https"
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._stop_parsing:
            if self._lingering:
                self._linger_more()
            return  # dropped: the connection is ending
        body_before = self._body_seen
        try:
            self.parser.feed_data(data)
            if self._lingering:
                return
            if self._in_head:
                self._raw_head_bytes += len(data)
                if self._raw_head_bytes > self.settings.max_header_bytes:
                    raise _Refused(431, "request header fields too large")
            elif self._parsing is not None:
                self._framing_bytes += len(data) - (self._body_seen - body_before)
                if self._framing_bytes > (2 * self.settings.max_header_bytes
                                          + CHUNK_FRAMING_BYTES * self._chunks):
                    raise _Refused(431, "chunk extensions or trailers too large")
        except _Refused as refused:
            self._refuse(refused.status, str(refused))
        except httptools.HttpParserUpgrade:
            # An Upgrade (h2c, websocket) is not offered: a request without a
            # body is answered as a plain one, then the connection closes.
            last = self._queued[-1] if self._queued else self._current
            if last is not None and any(name in (b"content-length", b"transfer-encoding")
                                        for name, _ in last.scope["headers"]):
                self._refuse(400, "an upgrade request with a body is not served")
                return
            self._stop_parsing = True
            for request in (self._current, *self._queued):
                if request is not None:
                    request.keep_alive = False
        except httptools.HttpParserCallbackError as error:
            cause = error.__context__
            if isinstance(cause, _PipelineFull):
                self._stop_parsing = True  # the waiting ones are answered, then it closes
                self._queued[-1].keep_alive = False
            elif isinstance(cause, _Refused):
                self._refuse(cause.status, str(cause))
            else:
                self._refuse(400, "malformed request")
        except httptools.HttpParserError:
            self._refuse(400, "malformed request")

    def eof_received(self) -> bool | None:
        # The client will send no more. Over plain TCP a request in flight is
        # still answered (the write side stays open); a TLS transport closes
        # after the peer's close_notify whatever this returns.
        self._eof = True
        if self._current is None and not self._queued:
            self._close()
        return self._scheme == "http"

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        try:
            self._cancel_idle_timer()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            for request in (self._current, self._parsing, *self._queued):
                if request is not None:
                    request.disconnect.fire()
                    request.wake()
            self._queued.clear()
            if self._writable is not None and not self._writable.done():
                self._writable.set_result(None)
        finally:  # the cap's slot comes back whatever a disconnect callback did
            if self._on_lost is not None:
                on_lost, self._on_lost = self._on_lost, None
                on_lost()
            if self._on_closed is not None:
                self._on_closed(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    async def writable(self) -> None:
        while self.write_paused and not self.lost:
            if self._writable is None or self._writable.done():
                self._writable = self.loop.create_future()
            await self._writable

    # -- llhttp callbacks ----------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._framing_bytes = self._chunks = 0
        self._url = b""
        self._headers = []
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer field: not a header (RFC 9110 6.5.1); dropped, as h11 does
        self._count_head(len(name) + len(value) + 4)
        self._headers.append((name.lower(), value))

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_headers_complete(self) -> None:
        if self._current is not None and len(self._queued) >= MAX_PIPELINED:
            raise _PipelineFull()  # this head is not served; the ones before it are
        self._cancel_idle_timer()
        self._in_head = False
        self._raw_head_bytes = 0
        parser = self.parser
        version = parser.get_http_version()
        headers = self._headers
        if version not in ("1.1", "1.0"):
            raise _Refused(505, "HTTP/1.1 and HTTP/1.0 only on this connection")
        hosts = [value for name, value in headers if name == b"host"]
        if version == "1.1" and (len(hosts) != 1 or not hosts[0].strip()):
            raise _Refused(400, "an HTTP/1.1 request needs exactly one host header")
        if version == "1.0" and any(name == b"transfer-encoding" for name, _ in headers):
            raise _Refused(400, "transfer-encoding on HTTP/1.0 (RFC 9112 6.1)")
        try:
            parsed = httptools.parse_url(self._url)
            raw_path = parsed.path or b"/"
            path = unquote(raw_path.decode("ascii"))
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError) as error:
            raise _Refused(400, "malformed request target") from error
        self._requests += 1
        keep_alive = (parser.should_keep_alive() and not self.draining
                      and self._requests < self.settings.max_requests)
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "method": parser.get_method().decode("ascii"),
            "scheme": self._scheme,
            "path": path,
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "root_path": "",
            "headers": headers,
            "client": self._client,
            "server": self._server,
            "extensions": {DISCONNECT_EXTENSION: Disconnect()},
        }
        expect = version == "1.1" and any(name == b"expect" and value.lower() == b"100-continue"
                                          for name, value in headers)
        request = _Request(self, scope, keep_alive, expect)
        self._parsing = request
        if self._current is None:
            self._start(request)
        else:
            self._queued.append(request)
            self._pause_reading()  # one request answered at a time

    def on_body(self, body: bytes) -> None:
        request = self._parsing
        if request is None:
            return
        self._body_seen += len(body)
        request.body.append(body)
        request.buffered += len(body)
        if request.buffered > BODY_HIGH_WATER:
            self._pause_reading()
        request.wake()

    def on_message_complete(self) -> None:
        request = self._parsing
        self._parsing = None
        if request is not None:
            request.complete = True
            request.wake()

    # -- the connection's requests -------------------------------------------

    def _start(self, request: _Request) -> None:
        self._current = request
        self.loop.create_task(self._run(request), context=self._context)

    async def _run(self, request: _Request) -> None:
        try:
            await self.settings.app(request.scope, request.receive, request.send)
        except asyncio.CancelledError:
            self._abort_response(request)
            raise
        except Exception:  # noqa: BLE001 -- the app failed; the client gets a 500 or a cut
            log.exception("the application failed on %s %s", request.scope["method"],
                          request.scope["path"])
            self._abort_response(request)
        else:
            if not request.ended:
                self._abort_response(request)

    def _abort_response(self, request: _Request) -> None:
        if request.ended or request.dropped or self.lost:
            return
        if not request.head_written:  # nothing written: a plain 500
            request.keep_alive = False
            request.declared_length = None  # what a refused head declared is not this answer's
            request.chunked = False
            request.started = True
            request.status = 500
            request.headers = [(b"content-type", b"text/plain; charset=utf-8")]
            body = b"internal server error"
            self.transport.write(request._head(len(body), False) + body)
            request.head_written = request.ended = True
            request.wake()
            self.response_ended(request)
            return
        # Part of the answer is out: only cutting the connection tells the client.
        request.ended = True
        request.wake()
        self.transport.close()

    def body_taken(self, request: _Request) -> None:
        if request is self._current and not self._queued and self._reading_paused:
            self._resume_reading()

    def response_ended(self, request: _Request) -> None:
        if request is not self._current:
            return
        self._current = None
        if not request.complete and not self.lost:
            # Answered before its body was all sent (a 413, a 401): the rest is
            # read and dropped for a while so the client sees the answer
            # rather than a reset, then the connection closes.
            self._linger(EARLY_ANSWER_LINGER_S)
            return
        if not request.keep_alive or self.draining or self.lost or self._eof:
            self._close()
            return
        if self._queued:
            self._start(self._queued.popleft())
            if not self._queued:
                self._resume_reading()
            return
        self._arm_idle_timer()
        self._resume_reading()

    # -- closing -------------------------------------------------------------

    def shutdown(self) -> None:
        """The server is stopping: idle, close now; busy, close after the answer."""
        self.draining = True
        for request in (self._current, *self._queued):
            if request is not None:
                request.keep_alive = False
        if self._current is None:
            self._close()

    def _close(self) -> None:
        self._cancel_idle_timer()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, reason: str) -> None:
        """An error answer, if none is under way, then a lingering close."""
        self._stop_parsing = True
        current = self._current
        for request in (current, *self._queued):
            if request is not None and not request.head_written:
                request.dropped = True  # the app's answer, if it comes, is dropped
                request.disconnect.fire()  # and it stops waiting for a body
                request.wake()
        self._queued.clear()
        if current is None or not current.head_written:
            body = reason.encode() + b"\n"
            self.transport.write(
                (_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status)
                + b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body)
                + _DATE.line() + b"connection: close\r\n\r\n" + body)
        self._linger()

    def _linger(self, at_most_s: float = LINGER_MAX_S) -> None:
        self._cancel_idle_timer()
        self._lingering = True
        self._linger_until = self.loop.time() + at_most_s
        self._linger_idle_s = min(LINGER_IDLE_S, at_most_s)
        self._linger_more()

    def _linger_more(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        delay = min(self._linger_idle_s, max(0.0, self._linger_until - self.loop.time()))
        self._linger_timer = self.loop.call_later(delay, self._close)

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        self._idle_timer = self.loop.call_later(self.settings.keep_alive_timeout_s, self._close)

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.settings.max_header_bytes:
            raise _Refused(431, "request header fields too large")

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.lost:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()
