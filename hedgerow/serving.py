"""Serving an internal ASGI app (control plane, worker, admin listeners).

The public, TLS/QUIC side of the gateway lives in ``gateway.edge.transport``; this
is the small internal twin: HTTP/1.1 over mutual TLS with the context the
caller gives (``hedgerow.trust.credentials.TlsContexts.server``), so that a
connection without a certificate from the cluster CA is refused in the
handshake; plain HTTP only when ``tls`` is None (``--insecure-internal``).
Binding the socket ourselves lets callers ask for port 0 and learn the real
port before clients are told about it.

With a ``connection_cap`` (the control plane's listeners:
``hedgerow.listener_limits``) connections are admitted as on the gateway's
public port: per-client limits, then the cap, at accept and before any TLS
byte (``hedgerow.connection_cap``); over TLS only (``--insecure-internal`` is
a debugging mode and stays unbounded).
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskStatus
from hypercorn.asyncio import serve
from hypercorn.config import Config

from hedgerow.asgi import Receive, Scope, Send
from hedgerow.connection_cap import ACTIVE_CAP, ConnectionCap
from hedgerow.http_stack import accept_loop, disconnect_hook, eof, linger
from hedgerow.trust.peer import install_peer_capture

App = Callable[[Scope, Receive, Send], Awaitable[None]]
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
# Connections the kernel completed wait here for the accept loop, which
# refuses at once what is over the limits: this only absorbs bursts.
ACCEPT_BACKLOG = 1024


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class _ContextConfig(Config):
    """A hypercorn Config that serves TLS with one given, live SSLContext (so a
    renewed certificate, loaded into it in place, is used by new handshakes)."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        super().__init__()
        self._context = context

    @property
    def ssl_enabled(self) -> bool:
        return self._context is not None

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self._context


def internal_config(sock: socket.socket, *, graceful_timeout: float = 5.0,
                    tls: ssl.SSLContext | None = None) -> Config:
    config = _ContextConfig(tls)
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = graceful_timeout
    config.keep_alive_timeout = 75.0
    config.include_server_header = False
    return config


async def serve_internal(
    app: App,
    host: str,
    port: int,
    shutdown: anyio.Event,
    *,
    tls: ssl.SSLContext | None = None,
    connection_cap: ConnectionCap | None = None,
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown`` is set; report the bound port on start.
    ``connection_cap``: admit connections through it (TLS only)."""
    eof.install()
    linger.install()
    disconnect_hook.install()
    install_peer_capture()
    # Hypercorn's worker opens its listeners with ``asyncio.start_server``; the
    # accept loop applies the cap in ``ACTIVE_CAP`` (none: it is start_server
    # itself). The gateway's transport installs the same (idempotent).
    accept_loop.install()
    # A context variable: set in this task, seen by the hypercorn worker it
    # runs, and by no other listener (each is served in a task of its own).
    ACTIVE_CAP.set(connection_cap)
    sock = bind_tcp(host, port)
    # Listening now: the capped accept loop takes the socket as it is
    # (``asyncio.start_server`` would have called listen itself).
    sock.listen(ACCEPT_BACKLOG)
    bound_port = int(sock.getsockname()[1])
    config = internal_config(sock, tls=tls)
    config.ssl_handshake_timeout = handshake_timeout_s
    config.backlog = ACCEPT_BACKLOG
    task_status.started(bound_port)
    await serve(app, config, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]
