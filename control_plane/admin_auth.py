"""The admin token that guards the control plane's operator API.

Operators send ``Authorization: Bearer <token>``; the token is separate from
tenant API keys, compared in constant time, and never logged. Without a
configured token the admin API is open, so the listener that serves it binds
to loopback only (see ``admin_bind_host``). With ``--admin-port`` the admin
routes get a listener of their own (``ControlPlaneRoutes``), apart from the
one workers and gateways use.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from hedgerow.asgi import Handler, Request, Router
from hedgerow.errors import AuthenticationFailed
from hedgerow.trust.identity import Role

if TYPE_CHECKING:
    from control_plane.trust_service import TrustService

log = logging.getLogger("hedgerow.control_plane.admin")

TOKEN_ENV = "HEDGEROW_ADMIN_TOKEN"
LOOPBACK = "127.0.0.1"
MAX_TOKEN_CHARS = 4096


def read_admin_token(token_file: Path | None) -> str | None:
    """The token from ``token_file`` (whitespace stripped), else ``$HEDGEROW_ADMIN_TOKEN``,
    else None. Raises ``ValueError`` for an empty or oversized token."""
    raw = token_file.read_text() if token_file is not None else os.environ.get(TOKEN_ENV)
    if raw is None:
        return None
    token = raw.strip()
    where = str(token_file) if token_file is not None else f"${TOKEN_ENV}"
    if not token or len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"the admin token in {where} must be 1-{MAX_TOKEN_CHARS} "
                         "characters without spaces")
    return token


def admin_bind_host(host: str, token: str | None) -> str:
    """Where to listen: as asked with a token; loopback only without one."""
    if token is not None:
        return host
    if _is_loopback(host):
        log.warning("no admin token configured (--admin-token-file or $%s): the admin API "
                    "is unauthenticated; listening on loopback only", TOKEN_ENV)
        return host
    log.warning("no admin token configured (--admin-token-file or $%s): the admin API would "
                "be unauthenticated, so listening on %s instead of %s", TOKEN_ENV, LOOPBACK, host)
    return LOOPBACK


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdminGuard:
    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token is not None else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def protect(self, handler: Handler) -> Handler:
        """``handler`` behind the token check (unchanged when no token is set)."""
        if self._token is None:
            return handler

        async def guarded(request: Request) -> None:
            self.check(request)
            await handler(request)

        return guarded

    def check(self, request: Request) -> None:
        assert self._token is not None
        scheme, _, presented = (request.header("authorization") or "").partition(" ")
        # compare_digest on bytes: constant time whatever the presented value.
        valid = scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode(), self._token)
        if not valid:
            raise AuthenticationFailed(
                "this is the control plane's admin API: send the admin token as "
                "'Authorization: Bearer <token>'", code="invalid_admin_token")


class CallerCheck:
    """Each route's check of its caller's certificate identity (the TLS handshake
    already proved the certificate chains to the cluster CA). ``trust`` None:
    ``--insecure-internal``, where nothing is checked."""

    def __init__(self, trust: TrustService | None) -> None:
        self.trust = trust

    def require(self, handler: Handler, roles: tuple[Role, ...]) -> Handler:
        trust = self.trust
        if trust is None:
            return handler

        async def checked(request: Request) -> None:
            trust.caller(roles)
            await handler(request)

        return checked


@dataclass(frozen=True)
class ControlPlaneRoutes:
    """Where each control-plane route goes and who may call it: ``internal``
    routes name the roles they serve (a worker registers, a gateway watches);
    ``admin`` routes are for operators (role ``admin``, and the admin token when
    one is configured). One table unless the admin API has a listener of its own."""

    open_table: Router
    admin_table: Router
    guard: AdminGuard
    callers: CallerCheck = CallerCheck(None)

    def internal(self, method: str, path: str, handler: Handler, *,
                 roles: tuple[Role, ...]) -> None:
        self.open_table.add(method, path, self.callers.require(handler, roles))

    def admin(self, method: str, path: str, handler: Handler) -> None:
        guarded = self.guard.protect(handler)
        self.admin_table.add(method, path, self.callers.require(guarded, ("admin",)))
