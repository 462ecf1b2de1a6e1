"""The admin token that guards the control plane's operator API.

Operators send ``Authorization: Bearer <token>``; the token is separate from
tenant API keys, compared in constant time, and never logged. Without a
configured token the admin API is open, so the listener that serves it binds
to loopback only (see ``admin_bind_host``). With ``--admin-port`` the admin
routes get a listener of their own (``ControlPlaneRoutes``), apart from the
one workers and gateways use.

``GET /metrics`` is served with the admin routes, never on a public or
worker-facing listener, so whatever guards the admin listener guards it. It
also opens to a read-only metrics token (``--metrics-token-file`` or
``$HEDGEROW_METRICS_TOKEN``): Prometheus holds that one, never the admin
token, which can change policies or purge caches. Without a metrics token
``/metrics`` wants the admin token, like every admin route; with neither it is
open, on a listener kept on loopback.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Sequence
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
METRICS_TOKEN_ENV = "HEDGEROW_METRICS_TOKEN"
LOOPBACK = "127.0.0.1"
MAX_TOKEN_CHARS = 4096


def read_admin_token(token_file: Path | None) -> str | None:
    """The token from ``token_file`` (whitespace stripped), else ``$HEDGEROW_ADMIN_TOKEN``,
    else None. Raises ``ValueError`` for an empty or oversized token."""
    return _read_token(token_file, TOKEN_ENV, "admin")


def read_metrics_token(token_file: Path | None) -> str | None:
    """The read-only ``/metrics`` token: ``token_file``, else ``$HEDGEROW_METRICS_TOKEN``."""
    return _read_token(token_file, METRICS_TOKEN_ENV, "metrics")


def _read_token(token_file: Path | None, env: str, what: str) -> str | None:
    raw = token_file.read_text() if token_file is not None else os.environ.get(env)
    if raw is None:
        return None
    token = raw.strip()
    where = str(token_file) if token_file is not None else f"${env}"
    if not token or len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"the {what} token in {where} must be 1-{MAX_TOKEN_CHARS} "
                         "characters without spaces")
    return token


def presents_token(request: Request, tokens: Sequence[bytes]) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <one of tokens>``."""
    scheme, _, presented = (request.header("authorization") or "").partition(" ")
    given = presented.strip().encode()
    # compare_digest on bytes: constant time whatever the presented value; every
    # token is compared (a list, not any() over a generator), so the time taken
    # does not tell which one matched.
    matches = [hmac.compare_digest(given, token) for token in tokens]
    return scheme.lower() == "bearer" and any(matches)


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
    def __init__(self, token: str | None, metrics_token: str | None = None) -> None:
        self._token = token.encode() if token is not None else None
        self._metrics_tokens = [t.encode() for t in (token, metrics_token) if t is not None]

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

    def protect_metrics(self, handler: Handler) -> Handler:
        """``handler`` behind the metrics token or the admin token (either opens it)."""
        if not self._metrics_tokens:
            return handler

        async def guarded(request: Request) -> None:
            if not presents_token(request, self._metrics_tokens):
                raise AuthenticationFailed(
                    "this is the control plane's /metrics: send the metrics token (or the "
                    "admin token) as 'Authorization: Bearer <token>'",
                    code="invalid_metrics_token")
            await handler(request)

        return guarded

    def check(self, request: Request) -> None:
        assert self._token is not None
        if not presents_token(request, [self._token]):
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
    one is configured); ``metrics`` beside them for Prometheus (role
    ``admin``, and the metrics or admin token when one is configured). One table unless the admin API has a listener of its own."""

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

    def metrics(self, method: str, path: str, handler: Handler) -> None:
        """Where the admin routes are, behind the metrics token or the admin token."""
        guarded = self.guard.protect_metrics(handler)
        self.admin_table.add(method, path, self.callers.require(guarded, ("admin",)))
