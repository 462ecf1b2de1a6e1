"""The gateway's transport: Hypercorn serving one ASGI app on ONE port.

    TCP  port P  TLS (1.2 minimum, ALPN h2 + http/1.1)  HTTP/2, HTTP/1.1
    UDP  port P  QUIC (TLS 1.3)                         HTTP/3

Every h1/h2 response advertises ``alt-svc: h3=":P"; ma=3600``, so clients
that start on TCP can move to HTTP/3.

Returning clients resume instead of repeating the full handshake: on TCP with
TLS 1.3 (and 1.2) session tickets (OpenSSL issues two per connection), sealed
under keys rotated every ``ticket_rotation_s`` (``gateway.edge.ticket_keys``); on
QUIC with tickets kept in ``QUIC_SESSION_TICKETS`` (see
``install_hypercorn_patches``), retired on the same schedule. Nagle is off
(``TCP_NODELAY``) on the listening sockets and, through asyncio, on every
accepted one, so each SSE token leaves as soon as it is written.

Usage, inside an anyio task group on the asyncio backend::

    config = build_config(host=["127.0.0.1", "::1"], port=0, certfile=c, keyfile=k)
    port = await task_group.start(serve, app, config, stop_event.wait)

``port`` is the real port, the same for TCP and UDP. The sockets already
listen when ``serve`` reports it, so the kernel queues early connections.
"""

from __future__ import annotations

import logging

import copy
import datetime
import errno
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import hypercorn.asyncio.run
from anyio.abc import TaskStatus
from hypercorn.config import Config, Sockets
from hypercorn.typing import ASGIFramework
from hypercorn.utils import wrap_app

from gateway.edge.cert_reload import (ACTIVE_CERTIFICATES, CertificateReloader,
                                 install_quic_certificate_registry, register_tls_context)
from hedgerow.connection_cap import ACTIVE_CAP, ConnectionCap
from gateway.edge.h2_budget import H2Limits
from gateway.edge.h2_guard import install_h2_guard
from gateway.edge.quic_admission import QuicFrontDoor, QuicLimits
from gateway.edge.sockets import open_listening_socket
from gateway.edge.quic_cap import ACTIVE_QUIC_DOOR, install_quic_cap, screen_datagram
from gateway.edge.write_coalescing import CoalescingWriter, install_write_coalescing
from hedgerow.http_stack import (accept_loop, disconnect_hook, eof, linger, quic_connection,
                                 udp_server)
from hedgerow.decimal_text import parse_decimal
from hedgerow.h1 import ACTIVE_H1, H1Settings
from gateway.edge.quic_tickets import QuicTicketStore
from gateway.edge.ticket_keys import DEFAULT_ROTATION_S, TicketKeyRing, install_ticket_keys

__all__ = [
    "QUIC_SESSION_TICKETS",
    "Listeners",
    "H2Limits",
    "TlsConfig",
    "bind_listeners",
    "build_config",
    "install_hypercorn_patches",
    "local_hosts",
    "serve",
]

DEFAULT_HOST = "127.0.0.1"
# What a local run binds: browsers resolve ``localhost`` to ::1 first, and a
# connection forced onto QUIC does not fall back to 127.0.0.1.
LOCAL_HOSTS = ("127.0.0.1", "::1")
PORT_PICK_ATTEMPTS = 32
ALT_SVC_MAX_AGE_S = 3600

# Bounds on what a slow or hostile client can hold (hypercorn 0.18 knobs):
# - A TCP connection must finish its TLS handshake within this (default 60 s).
TLS_HANDSHAKE_TIMEOUT_S = 5.0
# - Idle connections close after this; the timer runs from the handshake until
#   a request's headers are complete, so a slowloris that trickles its headers
#   is closed after it too, whatever it still sends.
KEEP_ALIVE_TIMEOUT_S = 5.0
# - Requests per connection (nginx's keepalive_requests is 1000): HTTP/1.1
#   answers the last with ``connection: close``; HTTP/2 drains gracefully
#   (GOAWAY naming the last stream, streams in flight finish;
#   ``gateway.edge.h2_guard``). Per-connection HTTP/2 flood budgets: ``H2Limits``.
MAX_REQUESTS_PER_CONNECTION = 10_000
# - Open TCP connections: a ``ConnectionCap`` passed to ``serve`` (gateway
#   ``--max-connections``) closes the ones beyond it at accept, before TLS.
#   Connections the kernel completed wait in the accept queue for at most
#   this many; the gateway accepts (and refuses, at the cap) as fast as they
#   come, so the queue only absorbs bursts, and holds no Python memory.
ACCEPT_BACKLOG = 1024
# - An HTTP/1.1 request line plus headers larger than this get a 400 and the
#   connection closes (HTTP/2: the header list limit, checked by h2).
MAX_HEADER_BYTES = 16 * 1024
H2_MAX_HEADER_LIST_BYTES = 64 * 1024
# ``read_timeout`` stays None on purpose: it bounds every read on a connection,
# including the quiet minutes of a long SSE stream, when an HTTP/1.1 client
# has nothing to send; it would cut healthy streams.

# One per process, because the hook that feeds it patches a module: every
# QUIC listener in this process issues and accepts tickets through this store.
QUIC_SESSION_TICKETS = QuicTicketStore()

ShutdownTrigger = Callable[[], Awaitable[object]]


class TlsConfig(Config):
    """Hypercorn's config with its TLS context repaired for a public edge, and
    the HTTP/2 flood budgets ``gateway.edge.h2_guard`` reads from it."""

    h2_limits: H2Limits = H2Limits()

    # Seals and opens the TCP session tickets (None: OpenSSL's one key for the
    # context's life). Shared by copies of the config, as the context is.
    ticket_keys: TicketKeyRing | None = None

    # Each TCP connection's writer (``hedgerow.http_stack.write_coalescing``):
    # its writes of one loop pass leave as one TLS record.
    wrap_writer: Any = CoalescingWriter

    # HTTP/1.1 clients served by ``hedgerow.h1`` instead of hypercorn's h11
    # path (``hedgerow gateway --http1 native``); HTTP/2 and HTTP/3 unchanged.
    native_http1: bool = False

    def create_ssl_context(self) -> ssl.SSLContext | None:
        context = super().create_ssl_context()
        if context is None:
            return None
        # Hypercorn assigns ``options = OP_NO_COMPRESSION``, which clears the
        # defaults; put back the ones that matter at an edge. Never set
        # OP_NO_TICKET: session tickets are how returning TLS clients resume.
        context.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
        context.options &= ~ssl.OP_NO_TICKET
        register_tls_context(context)  # the certificate reloader in force, if any
        if self.ticket_keys is not None:
            install_ticket_keys(context, self.ticket_keys)  # warns if it cannot
        return context


def local_hosts() -> tuple[str, ...]:
    """``LOCAL_HOSTS``, less ::1 on a machine without IPv6 loopback."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        logging.getLogger("hedgerow.gateway").warning(
            "no IPv6 loopback (::1) here: serving 127.0.0.1 only")
        return (DEFAULT_HOST,)
    return LOCAL_HOSTS


def build_config(
    *,
    host: str | Sequence[str] = DEFAULT_HOST,
    port: int,
    certfile: Path,
    keyfile: Path,
    http3: bool = True,
    graceful_timeout_s: float = 5.0,
    h2_limits: H2Limits = H2Limits(),
    max_requests_per_connection: int = MAX_REQUESTS_PER_CONNECTION,
    ticket_rotation_s: float | None = DEFAULT_ROTATION_S,
    native_http1: bool = False,
) -> Config:
    """Hypercorn config for TLS on TCP (h2, http/1.1) and, if http3, QUIC on UDP.

    ``host`` is one IP literal or several (e.g. ``["127.0.0.1", "::1"]``);
    all share ``port``. Port 0 means "pick one free on TCP and UDP alike".
    Session ticket keys (TCP) and tickets (QUIC) are rotated every
    ``ticket_rotation_s`` (None: never, OpenSSL's and aioquic's defaults).
    """
    hosts = [host] if isinstance(host, str) else list(host)
    if not hosts:
        raise ValueError("at least one host to bind is required")
    config = TlsConfig()
    # Hypercorn's own stderr handler would print every line twice next to ours.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = None
    config.bind = [_bind_string(name, port) for name in hosts]
    config.quic_bind = list(config.bind) if http3 else []
    config.certfile = str(certfile)
    config.keyfile = str(keyfile)
    config.alpn_protocols = ["h2", "http/1.1"]
    config.graceful_timeout = graceful_timeout_s
    config.ssl_handshake_timeout = TLS_HANDSHAKE_TIMEOUT_S
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    config.backlog = ACCEPT_BACKLOG
    # Hypercorn's own HTTP/2 check at this limit dropped every stream in
    # flight; the guard drains first, so hypercorn's check never fires.
    config.keep_alive_max_requests = max_requests_per_connection
    config.h2_limits = h2_limits
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.h2_max_header_list_size = H2_MAX_HEADER_LIST_BYTES
    config.read_timeout = None
    if ticket_rotation_s is not None:
        config.ticket_keys = TicketKeyRing(ticket_rotation_s)
    config.native_http1 = native_http1
    return config


def native_http1_settings(app: ASGIFramework, config: Config) -> H1Settings | None:
    """What ``hedgerow.h1`` serves HTTP/1.1 with on this listener: the same
    bounds as the hypercorn path (None: hypercorn serves HTTP/1.1)."""
    if not getattr(config, "native_http1", False):
        return None
    return H1Settings(
        app=app,
        keep_alive_timeout_s=float(config.keep_alive_timeout),
        max_header_bytes=int(config.h11_max_incomplete_size),
        max_requests=int(config.keep_alive_max_requests),
        graceful_timeout_s=float(config.graceful_timeout),
        extra_headers=tuple((b"alt-svc", value.encode("latin-1"))
                            for value in config.alt_svc_headers))


async def serve(
    app: ASGIFramework,
    config: Config,
    shutdown_trigger: ShutdownTrigger,
    *,
    connection_cap: ConnectionCap | None = None,
    quic_door: QuicFrontDoor | None = None,
    certificates: CertificateReloader | None = None,
    listeners: Listeners | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown_trigger()`` returns, then drain and return.

    Reports the bound port through ``task_status``. With ``connection_cap``,
    TCP connections beyond its limit are closed at accept (``hedgerow.connection_cap``).
    ``quic_door`` bounds QUIC handshakes (Retry, half-open caps and timeout,
    HTTP/3 header limits: ``gateway.edge.quic_cap``); without one, a cap alone
    gets the default limits. Cancelling ``serve`` also
    drains gracefully (bounded by ``config.graceful_timeout``) before the
    cancellation propagates, so listeners are never abandoned half-open.
    With ``certificates``, the listeners' TLS and QUIC contexts are registered
    with it, so it can load a renewed certificate into them (``gateway.edge.cert_reload``).
    A failure inside hypercorn (e.g. the app's lifespan startup) propagates
    wrapped in an ExceptionGroup, as from any anyio task group.
    ``listeners``: serve these sockets, bound elsewhere (``gateway.edge.processes``),
    instead of binding ``config.bind``.
    """
    install_hypercorn_patches(QUIC_SESSION_TICKETS)
    ring = getattr(config, "ticket_keys", None)
    QUIC_SESSION_TICKETS.rotate_every(
        None if ring is None else datetime.timedelta(seconds=ring.period_s))
    if listeners is None:
        listeners = bind_listeners(config)
    try:
        config = _with_alt_svc(config, listeners)
        task_status.started(listeners.port)
        stop = anyio.Event()
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(_serve_until_stopped, app, config, listeners, stop,
                                  connection_cap, quic_door, certificates)
            try:
                await shutdown_trigger()
            finally:
                stop.set()
    finally:
        # Normally hypercorn has closed them already (closing twice is a
        # no-op); this covers a hypercorn that failed, or never started.
        listeners.close()


async def _serve_until_stopped(
    app: ASGIFramework, config: Config, listeners: Listeners, stop: anyio.Event,
    connection_cap: ConnectionCap | None, quic_door: QuicFrontDoor | None,
    certificates: CertificateReloader | None = None,
) -> None:
    # This task's own context: hypercorn's worker, started from it, opens its
    # TLS listeners through the cap (``HypercornAsyncio.start_server``) and
    # builds its TLS and QUIC contexts where the certificate reloader sees them.
    ACTIVE_CAP.set(connection_cap)
    ACTIVE_H1.set(native_http1_settings(app, config))
    ACTIVE_QUIC_DOOR.set(quic_door or QuicFrontDoor(QuicLimits(), connection_cap))
    ACTIVE_CERTIFICATES.set(certificates)
    # Shielded: hypercorn's shutdown path awaits (closing servers, draining
    # connections); under a cancelled scope those awaits would be cut short.
    # ``stop`` is what ends it, and the caller sets it on cancellation too.
    with anyio.CancelScope(shield=True):
        await hypercorn.asyncio.run.worker_serve(
            wrap_app(app, config.wsgi_max_body_size, "asgi"),
            config,
            sockets=listeners.hypercorn_sockets(),
            shutdown_trigger=stop.wait,
        )


@dataclass(frozen=True)
class Listeners:
    """Bound sockets: TCP ones already listening, all on ``port``."""

    port: int
    tcp: tuple[socket.socket, ...]
    udp: tuple[socket.socket, ...]

    def hypercorn_sockets(self) -> Sockets:
        return Sockets(
            secure_sockets=list(self.tcp), insecure_sockets=[], quic_sockets=list(self.udp)
        )

    def close(self) -> None:
        for sock in self.tcp + self.udp:
            sock.close()


def bind_listeners(config: Config) -> Listeners:
    """Bind ``config.bind`` on TCP and ``config.quic_bind`` on UDP, one port.

    With port 0 the kernel picks a TCP port that may be taken on UDP; then
    everything is closed and tried again, a bounded number of times.
    """
    tcp_hosts, port = _parse_binds(config.bind)
    udp_hosts, udp_port = _parse_binds(config.quic_bind) if config.quic_bind else ([], port)
    if udp_port != port:
        raise ValueError(f"bind and quic_bind must share one port, got {port} and {udp_port}")
    attempts = PORT_PICK_ATTEMPTS if port == 0 else 1
    for _ in range(attempts):
        try:
            return _bind_all(tcp_hosts, udp_hosts, port, config.backlog)
        except OSError as error:
            if port != 0 or error.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no port free on TCP and UDP in {attempts} attempts")


def _bind_all(tcp_hosts: list[str], udp_hosts: list[str], port: int, backlog: int) -> Listeners:
    opened: list[socket.socket] = []
    try:
        opened.append(open_listening_socket(tcp_hosts[0], port, socket.SOCK_STREAM, backlog))
        port = opened[0].getsockname()[1]  # the kernel's pick, if port was 0
        for host in tcp_hosts[1:]:
            opened.append(open_listening_socket(host, port, socket.SOCK_STREAM, backlog))
        for host in udp_hosts:
            opened.append(open_listening_socket(host, port, socket.SOCK_DGRAM, backlog))
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    tcp = tuple(opened[: len(tcp_hosts)])
    return Listeners(port=port, tcp=tcp, udp=tuple(opened[len(tcp_hosts) :]))



def _bind_string(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_binds(binds: Sequence[str]) -> tuple[list[str], int]:
    if not binds:
        raise ValueError("config.bind is empty")
    hosts: list[str] = []
    ports: set[int] = set()
    for bind in binds:
        host, separator, port_text = bind.rpartition(":")
        port = parse_decimal(port_text, max_digits=5)
        if not separator or port is None:
            raise ValueError(f"bind {bind!r} is not HOST:PORT")
        hosts.append(host.strip("[]"))
        ports.add(port)
    if len(ports) != 1:
        raise ValueError(f"all binds must share one port, got {sorted(ports)}")
    return hosts, ports.pop()


def _with_alt_svc(config: Config, listeners: Listeners) -> Config:
    # Hypercorn derives alt-svc from sockets it creates itself; these sockets
    # are ours, so name the real port here (a copy: port 0 stays reusable).
    config = copy.copy(config)
    if listeners.udp and not config.alt_svc_headers:
        config.alt_svc_headers = [f'h3=":{listeners.port}"; ma={ALT_SVC_MAX_AGE_S}']
    return config


def install_hypercorn_patches(tickets: QuicTicketStore) -> None:
    """Fill eight gaps in hypercorn 0.18 / aioquic 1.7.2. Idempotent.

    Each is one module of ``hedgerow.http_stack`` (what it changes, why, and
    how it fails if hypercorn's internals moved: its docstring); the
    behaviour the gateway plugs in lives beside this module.

    1. QUIC session tickets, and flow-control windows that move with the data
       delivered (``http_stack.quic_connection``, ``QUIC_SESSION_TICKETS``).
    2. A UDP server that screens Initials before its queue, holds a burst,
       and closes at shutdown (``http_stack.udp_server``, pgjones/hypercorn#373).
    3. HTTP/2: late DATA (a 413 before the body was read) no longer kills the
       connection; flood budgets; a graceful drain after the request limit;
       one flush per read (``gateway.edge.h2_guard`` via ``http_stack.h2_protocol``).
    4. TCP connections bounded at accept, before TLS (``http_stack.accept_loop``
       with the ``ConnectionCap`` given to ``serve``).
    5. A connection's writes leave once per loop pass (``gateway.edge.write_coalescing``
       via ``http_stack.write_coalescing``, this listener's ``TlsConfig.wrap_writer``).
    6. A connection the client closed no longer waits out its keep-alive timer
       (``http_stack.eof``); a request's app learns its client left through a
       callback, with no task waiting in ``receive()`` (``http_stack.disconnect_hook``);
       a connection the server cuts (GOAWAY, a 4xx for a bad head) reads and drops
       what its client still sends before closing, so the client reads why
       (``http_stack.linger``).
    7. QUIC connections bounded (cap, half-open, Retry, HTTP/3 header and QPACK
       limits: ``gateway.edge.quic_cap`` via ``http_stack.quic_front_door``).
    8. The QUIC certificate reloadable (``gateway.edge.cert_reload`` via
       ``http_stack.quic_certificates``).
    """
    install_h2_guard()
    install_write_coalescing()
    eof.install()
    linger.install()
    disconnect_hook.install()
    install_quic_cap()
    install_quic_certificate_registry()
    hooks = tickets.hooks()
    quic_connection.install(session_ticket_fetcher=hooks.session_ticket_fetcher,
                            session_ticket_handler=hooks.session_ticket_handler)
    udp_server.install(screen_datagram)
    accept_loop.install()
