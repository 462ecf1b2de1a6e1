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

Reading the tokens, comparing them and the loopback rule are
``hedgerow.admin_token``'s, shared with the gateway's admin listener.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hedgerow.admin_token import presents_token
from hedgerow.asgi import Handler, Request, Router
from hedgerow.errors import AuthenticationFailed
from hedgerow.trust.identity import Role

if TYPE_CHECKING:
    from control_plane.trust_service import TrustService


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
