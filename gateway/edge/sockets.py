"""Opening the gateway's listening sockets: one place for the options they all need."""

from __future__ import annotations

import socket


def open_listening_socket(host: str, port: int, kind: socket.SocketKind, backlog: int, *,
                          reuseport: bool = False) -> socket.socket:
    """A bound TCP (listening) or UDP socket, non-blocking.

    ``reuseport``: joins a ``SO_REUSEPORT`` group (``gateway.edge.processes``),
    which only a socket that asks for it too can join."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # An explicit proto matters: asyncio sets TCP_NODELAY on an accepted
    # socket only if its proto is IPPROTO_TCP, and accepted sockets copy the
    # listener's proto, which is 0 when left to default.
    proto = socket.IPPROTO_TCP if kind == socket.SOCK_STREAM else socket.IPPROTO_UDP
    sock = socket.socket(family, kind, proto)
    try:
        if family == socket.AF_INET6:
            # So "::" and "0.0.0.0" can both be bound on one port.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if kind == socket.SOCK_STREAM:
            # Only on TCP (restart over TIME_WAIT); on UDP it would let a
            # second process bind the same port and steal datagrams.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Linux copies it to accepted sockets: a second guarantee.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        if kind == socket.SOCK_STREAM:
            sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
