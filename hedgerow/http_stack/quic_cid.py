"""QUIC connection ids that name the gateway process owning the connection.

What: with ``install_cid_steering(index, count)``, every connection id a
server-side ``aioquic.quic.connection.QuicConnection`` issues -- the initial
host id (``_host_cids[0]``, also its ``initial_source_connection_id``) and
each id ``_replenish_connection_ids`` makes for NEW_CONNECTION_ID frames --
gets a first byte ``b`` with ``b % count == index``. ``new_server_cid`` makes
such an id for other server-chosen ids (the Retry's source id,
``gateway.edge.quic_cap``). Client connections are left alone.

Why: ``hedgerow gateway --processes N`` serves one UDP port from N processes,
one SO_REUSEPORT socket each, and a classic BPF program on the socket group
(``gateway.edge.processes``) hands each datagram to socket ``first byte of the
destination connection id % N``. A client addresses every packet after its
first Initials to an id this process chose, so the datagrams of a connection
reach the process that holds it, also after the client's address changes
(connection migration): the kernel's 4-tuple hash alone would send a migrated
client to a stranger.

Written against aioquic 1.7.2 (``PINNED``: ``QuicConnection.__init__`` sets
``_host_cids``, ``host_cid`` and ``_local_initial_source_connection_id``;
``_replenish_connection_ids`` appends ``QuicConnectionId``s to
``_host_cids``). The wrappers pass ``*args, **kwargs`` through and only
rewrite ids after aioquic made them. If the internals moved: ``PatchError``
at start naming the missing method. Scope: process (installed only in a child
of ``--processes N``; client connections are never touched).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

from aioquic.quic.connection import QuicConnection

from hedgerow.http_stack.patch import require, undo, wrap

NAME = "quic_cid"


@dataclass(frozen=True)
class Steering:
    index: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.count <= 256 or not 0 <= self.index < self.count:
            raise ValueError(f"process {self.index} of {self.count}: want 0 <= index < count <= 256")

    def first_byte(self) -> int:
        """A random byte ``b`` with ``b % count == index`` (uniform over those)."""
        choices = (256 - self.index + self.count - 1) // self.count
        return self.index + secrets.randbelow(choices) * self.count

    def steer(self, cid: bytes) -> bytes:
        if not cid:
            return cid
        return bytes([self.first_byte()]) + cid[1:]

    def owns(self, cid: bytes) -> bool:
        return bool(cid) and cid[0] % self.count == self.index


_STEERING: Steering | None = None


def active() -> Steering | None:
    return _STEERING


def new_server_cid(length: int) -> bytes:
    """A fresh server-chosen connection id, steered to this process when steering is on."""
    cid = os.urandom(length)
    return cid if _STEERING is None else _STEERING.steer(cid)


def install_cid_steering(index: int, count: int) -> None:
    """Make this process's server connections issue ids steered to ``index``
    of ``count`` (applied once; a later call replaces the numbers)."""
    global _STEERING
    steering = Steering(index, count)
    require(QuicConnection, "__init__", "_replenish_connection_ids", patch=NAME)

    def steer_init(init: Any) -> Any:
        def steered_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if _STEERING is not None and not self._is_client:
                first = self._host_cids[0]
                first.cid = _STEERING.steer(first.cid)
                self.host_cid = first.cid
                self._local_initial_source_connection_id = first.cid
        return steered_init

    def steer_replenish(replenish: Any) -> Any:
        def steered_replenish(self: Any, *args: Any, **kwargs: Any) -> None:
            issued = len(self._host_cids)
            replenish(self, *args, **kwargs)
            if _STEERING is not None and not self._is_client:
                for connection_id in self._host_cids[issued:]:
                    connection_id.cid = _STEERING.steer(connection_id.cid)
        return steered_replenish

    wrap(QuicConnection, "__init__", steer_init, patch=NAME)
    wrap(QuicConnection, "_replenish_connection_ids", steer_replenish, patch=NAME)
    _STEERING = steering


def uninstall_cid_steering() -> None:
    """Back to aioquic's own random ids (tests)."""
    global _STEERING
    _STEERING = None
    undo(NAME)
