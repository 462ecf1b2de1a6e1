"""A cap on a listener's open TCP connections, enforced at accept, before TLS.

Used by the gateway's public port and the control plane's listeners
(``hedgerow.listener_limits``).

Hypercorn bounds a connection only in time (handshake and keep-alive
timeouts) and accepts without limit, so a flood can take every file
descriptor and the memory of every TLS session at once. With a cap, a
connection accepted while ``limit`` are open is closed at once: no TLS byte
is read or written for it, the client reads EOF, and the connections already
open are served as before. Refusals are counted
(``hedgerow_connections_refused_total``) and logged at most once per
``LOG_EVERY_S``.

How, without forking hypercorn: its asyncio worker opens each TLS listener
with ``asyncio.start_server(callback, sock=..., ssl=..., ...)``, whose
server wraps every accepted socket in TLS at once. ``capped_start_server``
returns a ``CappedListener`` instead: its own accept loop
(``loop.sock_accept``) closes a connection over the cap before any transport
exists, and hands one under it to ``loop.connect_accepted_socket`` with the
same TLS context and handshake timeout, and the same stream protocol and
callback, that ``start_server`` would have used. (Upgrading a plain TCP
transport with ``start_tls`` instead would race uvloop, which starts reading
right after ``connection_made`` and would hand the ClientHello to the wrong
protocol.) The slot is given back when the connection is lost, whether the
handshake failed, timed out or the connection served and closed. The cap in
force is the one ``serve`` put in ``ACTIVE_CAP`` (a context variable, so two
servers in one process each keep their own).

In front of the cap, per-client limits (``hedgerow.source_limits``, held by
the cap as ``sources``): a connection whose source IP or prefix already has
too many open, or opens them too fast, is closed the same way, before the
cap is asked; its source's slots are given back with the cap's.

QUIC (HTTP/3) connections take slots of the same cap and of the same
per-client limits: see ``gateway.edge.quic_admission``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from ssl import SSLContext
from typing import Any

from hedgerow.h1.connection import ACTIVE_H1, H1Connection, H1Settings
from hedgerow.source_limits import SourceLimits

log = logging.getLogger("hedgerow.connections")

DEFAULT_MAX_CONNECTIONS = 4096
UNCAPPED = 2**62
LOG_EVERY_S = 10.0
ACCEPT_RETRY_S = 0.1
STREAM_LIMIT = 2**16  # asyncio.start_server's default reader limit

StreamCallback = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None]


class ConnectionCap:
    """Open connections against a limit (sans-IO: plain counting)."""

    def __init__(self, limit: int = DEFAULT_MAX_CONNECTIONS,
                 sources: SourceLimits | None = None, *, flag_prefix: str = "") -> None:
        if limit < 1:
            raise ValueError(f"the connection limit must be >= 1, not {limit!r}")
        self.limit = limit
        # The flags the log lines name: "" (gateway, control plane --port) or "join-".
        self.flag_prefix = flag_prefix
        self.sources = sources  # per-client limits asked first, at TCP accept
        self._sources_logged = 0
        self._sources_logged_at = -LOG_EVERY_S
        self.open = 0
        self.refused = 0
        self._refused_logged = 0
        self._logged_at = -LOG_EVERY_S

    def try_open(self) -> bool:
        """Take a slot for a new connection; False (and counted): at the cap."""
        if self.open >= self.limit:
            self.refused += 1
            return False
        self.open += 1
        return True

    def close(self) -> None:
        if self.open <= 0:
            raise RuntimeError("a connection closed that the cap never opened")
        self.open -= 1

    def refusals_to_log(self, now: float) -> int:
        """Refusals since the last log line, if one is due at ``now``; else 0."""
        new = self.refused - self._refused_logged
        if new == 0 or now - self._logged_at < LOG_EVERY_S:
            return 0
        self._refused_logged, self._logged_at = self.refused, now
        return new

    def source_refusals_to_log(self, now: float) -> int:
        """Per-client refusals since the last log line, if one is due at ``now``; else 0."""
        if self.sources is None:
            return 0
        refused = sum(self.sources.refused.values())
        new = refused - self._sources_logged
        if new == 0 or now - self._sources_logged_at < LOG_EVERY_S:
            return 0
        self._sources_logged, self._sources_logged_at = refused, now
        return new

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"open": self.open, "refused": self.refused, "limit": self.limit}
        if self.sources is not None:
            stats["sources"] = self.sources.stats()
        return stats


ACTIVE_CAP: ContextVar[ConnectionCap | None] = ContextVar("hedgerow_connection_cap", default=None)


class _Slot:
    """One connection's hold on the cap (and on its source's limits, from
    ``source``), given back exactly once."""

    def __init__(self, cap: ConnectionCap, source: str | None = None) -> None:
        self._cap: ConnectionCap | None = cap
        self._source = source

    def give_back(self) -> None:
        if self._cap is not None:
            cap, self._cap = self._cap, None
            cap.close()
            if self._source is not None and cap.sources is not None:
                cap.sources.release(self._source, asyncio.get_running_loop().time())


class _CountedStreamProtocol(asyncio.StreamReaderProtocol):
    """The protocol ``asyncio.start_server`` builds, plus: frees the slot when lost."""

    def __init__(self, slot: _Slot, callback: StreamCallback,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop), callback, loop=loop)
        self._slot = slot

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            super().connection_lost(exc)  # first: the stream ends whatever the count does
        finally:
            self._slot.give_back()


class _ChooseByAlpn(asyncio.Protocol):
    """Decides, once TLS is up, who serves the connection: a client that chose
    ``h2`` by ALPN (or a listener without native HTTP/1.1) gets hypercorn's
    stream protocol, as ``start_server`` would have built it; HTTP/1.1 gets
    ``hedgerow.h1.H1Connection``. The transport is handed to the one chosen
    (``set_protocol``), so this object is out of the path after
    ``connection_made``."""

    def __init__(self, slot: _Slot, callback: StreamCallback, loop: asyncio.AbstractEventLoop,
                 h1: H1Settings, listener: CappedListener) -> None:
        self._slot = slot
        self._callback = callback
        self._loop = loop
        self._h1 = h1
        self._listener = listener

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        chosen: asyncio.BaseProtocol
        if alpn == "h2":
            chosen = _CountedStreamProtocol(self._slot, self._callback, self._loop)
        else:
            connections = self._listener.h1_connections
            chosen = H1Connection(self._h1, self._loop, on_lost=self._slot.give_back,
                                  on_closed=connections.discard)
            connections.add(chosen)
        transport.set_protocol(chosen)
        chosen.connection_made(transport)
        if isinstance(chosen, H1Connection) and self._listener.closing:
            chosen.shutdown()  # its handshake ended after the listener closed

    def connection_lost(self, exc: Exception | None) -> None:  # lost before it chose
        self._slot.give_back()


class CappedListener:
    """A TLS listener that accepts with the cap in front: what ``capped_start_server``
    gives hypercorn in place of an ``asyncio.Server`` (it only calls ``close`` and
    ``wait_closed``)."""

    def __init__(self, sock: socket.socket, cap: ConnectionCap, callback: StreamCallback,
                 context: SSLContext, handshake_timeout: float | None,
                 h1: H1Settings | None = None) -> None:
        self._sock = sock
        # ``hedgerow.h1.H1Settings``: HTTP/1.1 clients are served natively.
        self._h1 = h1
        self.h1_connections: set[H1Connection] = set()
        self.closing = False
        self._cap = cap
        self._callback = callback
        self._context = context
        self._handshake_timeout = handshake_timeout
        # Handshakes under way, held here: the loop keeps only weak references to tasks.
        self._handshakes: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept_forever())
        # The listening socket closes once nothing waits on it any more.
        self._accepting.add_done_callback(lambda _: sock.close())

    def close(self) -> None:
        """Stop accepting; hypercorn's connections carry on (hypercorn drains
        them); native HTTP/1.1 ones close when idle or after their answer."""
        self._accepting.cancel()
        self.closing = True
        for connection in list(self.h1_connections):
            connection.shutdown()

    async def wait_closed(self) -> None:
        await asyncio.wait([self._accepting])
        if self._h1 is not None:  # answers under way, for the graceful timeout at most
            deadline = asyncio.get_running_loop().time() + self._h1.graceful_timeout_s
            while self.h1_connections and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            for connection in list(self.h1_connections):
                connection.transport.abort()

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, address = await loop.sock_accept(self._sock)
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as error:  # out of descriptors or buffers: let some close
                log.warning("accept failed (%s); retrying in %.1fs", error, ACCEPT_RETRY_S)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            self._admit(connection, address)

    def _admit(self, connection: socket.socket, address: Any) -> None:
        sources = self._cap.sources
        source = address[0] if sources is not None and isinstance(address, tuple) else None
        if source is not None and sources is not None and sources.exempt(source):
            source = None  # loopback, say: not limited, not tracked
        if source is not None:
            assert sources is not None
            refusal = sources.admit(source, asyncio.get_running_loop().time())
            if refusal is not None:
                connection.close()  # as at the cap: before any TLS byte
                _log_source_refusals(self._cap, source, refusal)
                return
        if not self._cap.try_open():
            if source is not None:
                assert sources is not None
                sources.release(source, asyncio.get_running_loop().time())
            connection.close()  # no TLS byte read or written: the client reads EOF
            log_refusals(self._cap)
            return
        task = asyncio.get_running_loop().create_task(
            self._serve(connection, _Slot(self._cap, source)))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _serve(self, connection: socket.socket, slot: _Slot) -> None:
        """TLS, then hypercorn's callback: what ``start_server(ssl=...)`` does for each."""
        loop = asyncio.get_running_loop()
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            h1 = self._h1
            if h1 is not None:
                def protocol() -> asyncio.BaseProtocol:
                    return _ChooseByAlpn(slot, self._callback, loop, h1, self)
            else:
                def protocol() -> asyncio.BaseProtocol:
                    return _CountedStreamProtocol(slot, self._callback, loop)
            await loop.connect_accepted_socket(
                protocol, connection,
                ssl=self._context, ssl_handshake_timeout=self._handshake_timeout,
                ssl_shutdown_timeout=TLS_SHUTDOWN_TIMEOUT_S)
        except OSError:  # the handshake failed, timed out or was cut; the socket is closed
            slot.give_back()
        except BaseException:
            slot.give_back()
            raise


def log_refusals(cap: ConnectionCap) -> None:
    refused = cap.refusals_to_log(asyncio.get_running_loop().time())
    if refused:
        log.warning("connection cap reached: %d connection(s) refused at accept (%d open, "
                    "limit %d; --%smax-connections)", refused, cap.open, cap.limit,
                    cap.flag_prefix)


def _log_source_refusals(cap: ConnectionCap, source: str, refusal: str) -> None:
    refused = cap.source_refusals_to_log(asyncio.get_running_loop().time())
    if refused:
        # Named only where on (the control plane has none: hedgerow.listener_limits).
        prefix = "/-prefix" if _has_prefix_limits(cap) else ""
        log.warning("per-client connection limits: %d connection(s) refused at accept "
                    "(the latest from %s: %s; --%smax-connections-per-ip%s, "
                    "--%snew-connections-per-ip%s)", refused, source, refusal,
                    cap.flag_prefix, prefix, cap.flag_prefix, prefix)


def _has_prefix_limits(cap: ConnectionCap) -> bool:
    config = cap.sources.config if cap.sources is not None else None
    return config is not None and bool(config.max_open_per_prefix or config.rate_per_prefix)


# How long a TLS close waits for the peer's close_notify (asyncio's default: 30 s).
# An idle client -- a browser tab with the chat page open -- never sends one
# until it next reads, so at shutdown every idle connection held the gateway
# for the full 30 s (measured: 30.3 s with one idle HTTP/2 connection; 1.3 s
# with this). The cost: on a close the server starts, a client that has not
# taken its last bytes within this time loses them; every such close follows a
# drained response (hypercorn awaits drain on each write) or a cut client.
TLS_SHUTDOWN_TIMEOUT_S = 1.0


async def capped_start_server(callback: StreamCallback, host: Any = None, port: Any = None,
                              *, sock: socket.socket | None = None,
                              ssl: SSLContext | None = None,
                              ssl_handshake_timeout: float | None = None,
                              **kwargs: Any) -> asyncio.Server | CappedListener:
    """``asyncio.start_server`` with the cap in ``ACTIVE_CAP`` in front of TLS, and
    HTTP/1.1 served by ``hedgerow.h1`` where ``ACTIVE_H1`` asks for it.

    Without a cap or native HTTP/1.1, TLS or a listening socket it is
    ``asyncio.start_server`` itself.
    """
    cap = ACTIVE_CAP.get()
    h1 = ACTIVE_H1.get()
    if cap is None and h1 is not None:
        cap = ConnectionCap(UNCAPPED)  # native HTTP/1.1 needs this accept loop, cap or none
    if cap is None or ssl is None or sock is None:
        if ssl is not None:
            kwargs.setdefault("ssl_shutdown_timeout", TLS_SHUTDOWN_TIMEOUT_S)
        return await asyncio.start_server(callback, host, port, sock=sock, ssl=ssl,
                                          ssl_handshake_timeout=ssl_handshake_timeout, **kwargs)
    return CappedListener(sock, cap, callback, ssl, ssl_handshake_timeout, h1)


class HypercornAsyncio:
    """The ``asyncio`` module as hypercorn's worker sees it: all of it, except that
    ``start_server`` is ``capped_start_server`` (``hedgerow.http_stack.accept_loop``)."""

    start_server = staticmethod(capped_start_server)

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)


FD_RESERVE = 256  # descriptors kept for listeners, workers, Redis, logs and files


def fit_file_limit(limit: int) -> int:
    """Raise this process's open-file limit to hold ``limit`` connections if the hard
    limit allows; return the cap that fits (lower than ``limit`` if it does not).

    Without this the soft limit (often 1024) would fail accepts long before the cap.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = limit + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as error:
            log.warning("cannot raise the open-file limit to %d: %s", raised, error)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return limit
    fitted = max(1, soft - FD_RESERVE)
    log.warning("--max-connections %d lowered to %d: the open-file limit is %d (ulimit -n)",
                limit, fitted, soft)
    return fitted
