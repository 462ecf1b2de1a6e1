"""A lean HTTP/1.1 client for the gateway's hot path: streaming from workers.

httpx was most of the gateway's CPU on a streamed request (pool scans and a
stack of wrappers around every chunk). This client does only what that path
needs: POST with a content-length body over a keep-alive connection, and a
response body read straight out of an ``asyncio.Protocol``'s buffer and
decoded by ``gateway.upstream.http1`` (sans-IO), one ``bytes`` per network read.

Pool rules (per origin — scheme, host, port): at most ``max_connections``
open, at most ``max_idle`` kept idle, idle ones dropped after ``idle_expiry_s``.
A connection goes back to the pool only when its response was read to the end
and neither side asked to close; an abandoned or cancelled response closes it,
so a half-read connection is never reused. A reused connection that dies before
any response byte arrived (the server closed it while idle: the keep-alive race)
is retried once on a fresh connection.

Internal workers are reached over mutual TLS (``peer`` given): the gateway
presents its own certificate, checks the worker's chain against the cluster
CA, and accepts it only if its identity URI is the one the registry names —
never a DNS name, so a worker registered at another's address gets no
traffic meant for that one. The identity is part of the pool key, and the
check runs once per connection: the handshake is paid once, then amortised.

Errors are ``gateway.upstream.http1.HttpError``s; ``gateway.upstream.client`` maps them once.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hedgerow.trust.credentials import TlsContexts
from hedgerow.trust.identity import identity_of_der
from gateway.upstream.http1 import (ChunkedBody, CloseDelimitedBody, ConnectFailed, ConnectionBroken,
                           ConnectTimeout, HttpError, LengthBody, PoolTimeout, ReadTimeout,
                           ResponseHead, WriteTimeout, body_framing, parse_head)

# scheme, host, port, and the identity URI the peer must prove ("" for none).
Origin = tuple[str, str, int, str]
Body = ChunkedBody | LengthBody | CloseDelimitedBody

READ_HIGH_WATER = 256 * 1024  # stop reading the socket while this much is unconsumed


@dataclass(frozen=True)
class PoolLimits:
    connect_s: float = 2.0  # also the longest wait for a free connection
    idle_s: float = 60.0  # the longest gap between two reads of a response
    write_s: float = 10.0
    max_connections: int = 1024  # per origin
    max_idle: int = 256  # per origin
    idle_expiry_s: float = 30.0  # workers keep idle connections 75 s


class Connection(asyncio.Protocol):
    """One socket: bytes land in ``buffer``; a reader awaits ``wait_readable``."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.lost = False  # the peer closed (EOF) or the socket failed
        self.received = False  # any byte since the current request was sent
        self.reused = False  # taken from the idle pool for the current request
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        # One idle timer per connection, re-armed only when it fires: a read
        # that is on time costs a clock read, not a timer.
        self._idle_timer: asyncio.TimerHandle | None = None
        self._wait_began = 0.0
        self._wait_limit_s = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.received = True
        if len(self.buffer) > READ_HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def eof_received(self) -> bool:
        self.lost = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def consumed(self) -> None:
        """The reader took bytes from ``buffer``: read the socket again if it was paused."""
        if self._reading_paused and len(self.buffer) < READ_HIGH_WATER // 2:
            self._reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    async def wait_readable(self, timeout_s: float) -> None:
        """Until more bytes arrive or the connection is lost; ReadTimeout after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._wait_began, self._wait_limit_s = loop.time(), timeout_s
        due = self._wait_began + timeout_s
        if self._idle_timer is None or self._idle_timer.when() > due:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer = loop.call_at(due, self._idle_check)
        try:
            await waiter
        finally:
            self._waiter = None

    def _idle_check(self) -> None:
        self._idle_timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait arms it again
        due = self._wait_began + self._wait_limit_s
        loop = asyncio.get_running_loop()
        if loop.time() >= due:
            _expire(waiter, ReadTimeout)
        else:
            self._idle_timer = loop.call_at(due, self._idle_check)

    async def send(self, data: bytes, timeout_s: float) -> None:
        self.received = False
        self.transport.write(data)  # type: ignore[union-attr]
        drained = self._drained
        if drained is not None:
            timer = asyncio.get_running_loop().call_later(timeout_s, _expire, drained,
                                                           WriteTimeout)
            try:
                await asyncio.shield(drained)
            finally:
                timer.cancel()

    def close(self) -> None:
        self.lost = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self.transport is not None:
            self.transport.abort()  # no lingering half-read connection


def _expire(waiter: asyncio.Future[None], error: type[HttpError]) -> None:
    if not waiter.done():
        waiter.set_exception(error(f"no progress for the {error.__name__} limit"))


class HttpResponse:
    """A response whose body is read as it arrives; ``aclose`` it unless read to the end."""

    def __init__(self, pool: HttpPool, conn: Connection, head: ResponseHead) -> None:
        self.status = head.status
        self.headers = head.headers  # lowercase names
        self._pool = pool
        self._conn: Connection | None = conn
        self._body: Body = body_framing(head)
        self._reusable = head.keep_alive and self._body.reusable

    async def chunks(self) -> AsyncIterator[bytes]:
        """The decoded body, one piece per network read (empty pieces skipped)."""
        conn, body = self._conn, self._body
        if conn is None:
            return
        idle_s = self._pool.limits.idle_s
        try:
            while True:
                data = body.decode(conn.buffer) if conn.buffer else b""
                conn.consumed()
                if conn.lost and not body.done:
                    body.at_eof()  # complete if close-delimited, else ConnectionBroken
                if body.done:
                    self._finish()
                    if data:
                        yield data
                    return
                if data:
                    yield data
                else:
                    await conn.wait_readable(idle_s)
        except BaseException:  # failed, cancelled or abandoned half-way: never reuse
            self._abandon()
            raise

    async def read_all(self, limit: int) -> bytes:
        """The body, up to ``limit`` bytes; beyond that the rest is dropped with the connection."""
        pieces: list[bytes] = []
        size = 0
        try:
            async for data in self.chunks():
                pieces.append(data)
                size += len(data)
                if size >= limit:
                    break
        finally:
            await self.aclose()
        return b"".join(pieces)[:limit]

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn, reusable=self._reusable and not conn.buffer)

    def _abandon(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn, reusable=False)

    async def aclose(self) -> None:
        self._abandon()


@dataclass
class _OriginPool:
    idle: deque[Connection] = field(default_factory=deque)
    total: int = 0  # open connections, idle ones included
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)


class HttpPool:
    """Keep-alive connections per origin; ``request`` sends one request and returns its head."""

    def __init__(self, limits: PoolLimits | None = None,
                 ssl_context: ssl.SSLContext | None = None,
                 internal_tls: TlsContexts | None = None) -> None:
        self.limits = limits or PoolLimits()
        self._ssl = ssl_context
        self._internal = internal_tls.client(check_hostname=False) if internal_tls else None
        self._origins: dict[Origin, _OriginPool] = {}
        self._targets: dict[str, tuple[Origin, bytes]] = {}  # url -> origin, request prefix

    async def request(self, method: str, url: str, headers: dict[str, str],
                      body: bytes, *, peer: str = "") -> HttpResponse:
        """``peer``: the identity URI an internal worker must prove (mutual TLS)."""
        origin, prefix = self._target(url)
        if peer:
            origin = (origin[0], origin[1], origin[2], peer)
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if lines.count("\n") != len(headers):
            raise HttpError("a request header contains a line break")
        data = b"".join((method.encode(), prefix, lines.encode("latin-1"),
                         b"content-length: %d\r\n\r\n" % len(body), body))
        conn = await self._acquire(origin, fresh=False)
        try:
            return await self._exchange(conn, data)
        except ConnectionBroken:
            if conn.received or not conn.reused:
                raise
        # The server closed the pooled connection as we sent: once more, on a new one.
        conn = await self._acquire(origin, fresh=True)
        return await self._exchange(conn, data)

    async def _exchange(self, conn: Connection, data: bytes) -> HttpResponse:
        try:
            await conn.send(data, self.limits.write_s)
            while True:
                head = parse_head(conn.buffer)
                if head is not None:
                    if 100 <= head.status < 200:  # interim (e.g. 103): the real one follows
                        continue
                    return HttpResponse(self, conn, head)
                if conn.lost:
                    raise ConnectionBroken("connection closed before a response")
                await conn.wait_readable(self.limits.idle_s)
        except BaseException:
            conn.close()
            self.release(conn, reusable=False)
            raise

    def _target(self, url: str) -> tuple[Origin, bytes]:
        known = self._targets.get(url)
        if known is None:
            try:
                parts = urlsplit(url)
            except ValueError:
                raise ConnectFailed(f"not a URL: {url!r}") from None
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConnectFailed(f"not an http(s) URL: {url!r}")
            # Whatever builds the URL, it may not pick another request line, another
            # header, or a host other than the one connected to.
            if (not url.isascii() or any(c <= " " or c == "\x7f" for c in url)
                    or "@" in parts.netloc or "#" in url):
                raise ConnectFailed(f"not a plain http(s) URL: {url!r}")
            try:
                port = parts.port or (443 if parts.scheme == "https" else 80)
            except ValueError:
                raise ConnectFailed(f"not a valid port in {url!r}") from None
            host = parts.netloc
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            prefix = f" {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")
            known = ((parts.scheme, parts.hostname, port, ""), prefix)
            if len(self._targets) < 4096:  # worker URLs are few; don't let them grow
                self._targets[url] = known
        return known

    async def _acquire(self, origin: Origin, *, fresh: bool) -> Connection:
        pool = self._origins.get(origin) or self._origins.setdefault(origin, _OriginPool())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.connect_s
        while True:
            conn = None if fresh else self._take_idle(pool, loop.time())
            if conn is not None:
                return conn
            if pool.total < self.limits.max_connections:
                pool.total += 1
                return await self._connect(origin, pool)
            await self._wait_for_slot(pool, deadline - loop.time())

    def _take_idle(self, pool: _OriginPool, now: float) -> Connection | None:
        while pool.idle:
            conn = pool.idle.pop()  # the most recently used: least likely to be stale
            fresh = now - conn.idle_since < self.limits.idle_expiry_s
            if fresh and not conn.lost and not conn.buffer:  # bytes while idle: not HTTP
                conn.reused = True
                return conn
            conn.close()
            pool.total -= 1
        return None

    async def _wait_for_slot(self, pool: _OriginPool, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise PoolTimeout(f"no free connection within {self.limits.connect_s:.1f}s")
        waiter = asyncio.get_running_loop().create_future()
        pool.waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            raise PoolTimeout(f"no free connection within {self.limits.connect_s:.1f}s") from None
        finally:
            if waiter in pool.waiters:
                pool.waiters.remove(waiter)

    async def _connect(self, origin: Origin, pool: _OriginPool) -> Connection:
        scheme, host, port, peer = origin
        tls = self._tls_for(peer) if scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.limits.connect_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(origin), host, port, ssl=tls,
                    server_hostname=host if tls else None)
        except BaseException as error:
            self._slot_freed(origin, pool)
            if isinstance(error, TimeoutError):
                raise ConnectTimeout(f"connect to {host}:{port} timed out") from None
            if isinstance(error, OSError):
                raise ConnectFailed(f"connect to {host}:{port}: {error}") from error
            raise
        if peer:
            self._check_peer(conn, pool, peer)
        sock = conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
        if sock is not None:  # tokens are small writes: never wait to coalesce them
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _tls_for(self, peer: str) -> ssl.SSLContext:
        if not peer:
            return self._tls_context()
        if self._internal is None:
            raise ConnectFailed("no internal TLS credentials to reach an internal worker")
        return self._internal

    def _check_peer(self, conn: Connection, pool: _OriginPool, peer: str) -> None:
        ssl_object = conn.transport.get_extra_info("ssl_object")  # type: ignore[union-attr]
        presented = identity_of_der(ssl_object.getpeercert(binary_form=True)
                                    if ssl_object is not None else None)
        if presented is None or presented.uri != peer:
            conn.close()
            self._slot_freed(conn.origin, pool)
            raise ConnectFailed(f"the worker at {conn.origin[1]}:{conn.origin[2]} proved "
                                f"{presented.uri if presented else 'no identity'}, not {peer}")

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:  # loading the CA bundle costs milliseconds: once
            self._ssl = ssl.create_default_context()
        return self._ssl

    def release(self, conn: Connection, *, reusable: bool) -> None:
        pool = self._origins[conn.origin]
        if not reusable or conn.lost:
            conn.close()
            self._slot_freed(conn.origin, pool)
            return
        now = asyncio.get_running_loop().time()
        self._prune(pool, now)
        if len(pool.idle) >= self.limits.max_idle:  # keep the fresh one, drop the oldest
            pool.idle.popleft().close()
            pool.total -= 1
        conn.idle_since = now
        conn.reused = False
        pool.idle.append(conn)
        _wake_one(pool.waiters)

    def _prune(self, pool: _OriginPool, now: float) -> None:
        """Drop idle connections that expired or that the server closed (oldest first)."""
        idle = pool.idle
        while idle and (idle[0].lost or now - idle[0].idle_since >= self.limits.idle_expiry_s):
            idle.popleft().close()
            pool.total -= 1

    def _slot_freed(self, origin: Origin, pool: _OriginPool) -> None:
        pool.total -= 1
        if pool.total == 0 and not pool.waiters:  # a worker that went away leaves nothing
            del self._origins[origin]
        else:
            _wake_one(pool.waiters)

    async def aclose(self) -> None:
        for pool in self._origins.values():
            while pool.idle:
                pool.idle.pop().close()
                pool.total -= 1


def _wake_one(waiters: deque[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
            return
