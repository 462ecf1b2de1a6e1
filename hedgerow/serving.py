"""Serving an internal ASGI app (control plane, worker) over plain HTTP/1.1.

The public, TLS/QUIC side of the gateway lives in ``gateway.transport``; this
is the small internal twin. Binding the socket ourselves lets callers ask for
port 0 and learn the real port before clients are told about it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskStatus
from hypercorn.asyncio import serve
from hypercorn.config import Config

from hedgerow.asgi import Receive, Scope, Send
from hedgerow.hypercorn_eof import install_eof_fix

App = Callable[[Scope, Receive, Send], Awaitable[None]]


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def internal_config(sock: socket.socket, *, graceful_timeout: float = 5.0) -> Config:
    config = Config()
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
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown`` is set; report the bound port on start."""
    install_eof_fix()
    sock = bind_tcp(host, port)
    bound_port = int(sock.getsockname()[1])
    config = internal_config(sock)
    task_status.started(bound_port)
    await serve(app, config, shutdown_trigger=shutdown.wait)  # type: ignore[arg-type]
