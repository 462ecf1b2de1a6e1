"""The verified peer of the current connection, for the application.

Hypercorn (0.18) gives an ASGI app no view of the client certificate (it does
not implement ASGI's ``tls`` extension). ``install_peer_capture`` hooks the
start of each connection's task (``hedgerow.http_stack.tls_peer``) to put the
connection's verified client certificate in the ``PEER`` context variable
first. Child tasks copy the context when they are created, so each request
sees its own connection's peer and no other. The upstream fix would be the
``tls`` scope extension (``docs/upstream/``).
"""

from __future__ import annotations

import datetime
import math
import ssl
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from cryptography import x509

from hedgerow.http_stack import tls_peer
from hedgerow.trust.ca import issued_at, joined_at
from hedgerow.trust.identity import Identity, identity_of
from hedgerow.trust.pem import PUBLIC_MODE, write_atomically


@dataclass(frozen=True)
class Peer:
    identity: Identity
    issued_at: datetime.datetime
    not_after: datetime.datetime
    joined_at: datetime.datetime  # its lineage's join: what revocation compares


PEER: ContextVar[Peer | None] = ContextVar("hedgerow_peer", default=None)


def peer_of(der: bytes | None) -> Peer | None:
    """The peer a verified DER client certificate speaks for (None: no identity)."""
    if not der:
        return None
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        return None
    identity = identity_of(cert)
    if identity is None:
        return None
    return Peer(identity, issued_at(cert), cert.not_valid_after_utc, joined_at(cert))


def install_peer_capture() -> None:
    """Idempotent."""
    tls_peer.install(_capture)


def _capture(ssl_object: ssl.SSLObject | None) -> None:
    # Only a certificate the handshake verified is ever returned here.
    PEER.set(peer_of(ssl_object.getpeercert(binary_form=True)) if ssl_object else None)


class Revocations:
    """Identities revoked on the control plane, as a worker learns them from its
    heartbeats: a certificate of one, issued in a lineage joined before its
    revocation, is refused though it still verifies. With a ``path`` the list is
    kept on disk too, so a restarted worker refuses them before its first heartbeat
    (or while the control plane is unreachable)."""

    MAX = 10_000

    def __init__(self, path: Path | None = None) -> None:
        self._revoked: dict[str, float] = {}
        self._path = path
        if path is not None:
            try:
                kept = self._valid(orjson.loads(path.read_bytes()))
            except (OSError, ValueError):
                kept = None
            if kept is not None:  # else none kept yet (or unreadable): the next heartbeat brings it
                self._revoked = kept

    def update(self, revoked: object) -> None:
        fresh = self._valid(revoked)
        if fresh is None or fresh == self._revoked:
            return
        self._revoked = fresh
        if self._path is not None:
            try:
                write_atomically(self._path, orjson.dumps(fresh), mode=PUBLIC_MODE)
            except OSError:
                pass  # kept in memory; the disk copy is a convenience for restarts

    def revoked(self, peer: Peer) -> bool:
        when = self._revoked.get(str(peer.identity))
        return when is not None and peer.joined_at.timestamp() <= when

    @classmethod
    def _valid(cls, revoked: object) -> dict[str, float] | None:
        if not isinstance(revoked, dict):
            return None
        return {str(k): float(v) for k, v in list(revoked.items())[:cls.MAX]
                if isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v)}


def require_roles(app: Any, roles: tuple[str, ...],
                  revocations: Revocations | None = None) -> Any:
    """``app`` behind a check of the peer's role (workers: only gateways and
    admins may call them) and of ``revocations``. ``lifespan`` passes through;
    refusals use the OpenAI error envelope."""
    from hedgerow.asgi import send_error
    from hedgerow.errors import AuthenticationFailed, PermissionDenied

    async def gated(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            peer = PEER.get()
            if peer is None:
                await send_error(send, AuthenticationFailed(
                    "an internal listener: present a client certificate from the cluster CA",
                    code="client_certificate_required"))
                return
            if revocations is not None and revocations.revoked(peer):
                await send_error(send, AuthenticationFailed(
                    f"{peer.identity} is revoked", code="identity_revoked"))
                return
            if peer.identity.role not in roles:
                await send_error(send, PermissionDenied(
                    f"{peer.identity} may not call this (only {', '.join(roles)})"))
                return
        await app(scope, receive, send)

    return gated
