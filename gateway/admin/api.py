"""The gateway's admin API: response-cache purge and stats, on a listener of its own.

``hedgerow gateway --admin-port N`` serves it over plain HTTP/1.1 on
``--admin-host`` (127.0.0.1 by default), apart from the public TLS port, so
it is never reachable where clients are:

- ``GET /admin/cache``: ``ResponseCache.stats()`` (``semantic``: the count
  of semantic hits) plus ``semantic_cache``: ``"off"`` (the policy's
  semantic cache is off, the shipped default: only exact hits),
  ``"loading"`` (on, the embedding model still loading: semantic lookups
  are misses) or ``"ready"``; and ``semantic_ready``, the embedding model
  has loaded.
- ``POST /admin/cache/purge`` with ``{"tenant"?, "model"?, "key"?}`` (at
  least one; together they must all match): removes the matching entries
  here and in Redis; other gateways on the same Redis drop their in-memory
  semantic copies through the shared stream. Answers ``{"purged": N}``, the
  entries this gateway removed. ``key`` is an exact key; ``model`` a name or
  alias; ``tenant`` the tenant's own namespace (shared namespaces: purge by
  model or key).

- ``GET /metrics``: the gateway's Prometheus metrics. Only here, never on
  the public port; with a metrics token (``--metrics-token-file`` or
  ``$HEDGEROW_METRICS_TOKEN``) that token or the admin token opens it, so
  Prometheus need not hold the admin token (it can purge).

With an admin token (``--admin-token-file`` or ``$HEDGEROW_ADMIN_TOKEN``,
the control plane's convention) every route wants
``Authorization: Bearer <token>``, compared in constant time; without one
the listener is forced onto loopback (a metrics token alone does not lift
that: the cache routes would be open). ``purge`` at the bottom is the
client ``hedgerow cache purge`` uses.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hedgerow.admin_token import presents_token
from hedgerow.asgi import Handler, Receive, Request, Router, Scope, Send, send_bytes, send_json
from hedgerow.errors import AuthenticationFailed, InvalidRequest
from hedgerow.metrics import CONTENT_TYPE

if TYPE_CHECKING:  # the CLI's client below needs none of the cache's imports
    from gateway.cache import ResponseCache

log = logging.getLogger("hedgerow.gateway.admin")

MAX_BODY = 4096
NAME = Field(default=None, min_length=1, max_length=256)


class PurgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str | None = NAME
    model: str | None = NAME
    key: str | None = NAME

    @model_validator(mode="after")
    def _something(self) -> PurgeRequest:
        if self.tenant is None and self.model is None and self.key is None:
            raise ValueError("name a tenant, a model or a key to purge")
        return self


# Renders the gateway's metrics (``GatewayApp.render_metrics``).
MetricsSource = Callable[[], Awaitable[bytes]]


@dataclass
class GatewayAdmin:
    """The admin ASGI app over one gateway's ``ResponseCache`` and its metrics."""

    cache: ResponseCache
    token: str | None = None
    metrics: MetricsSource | None = None  # None: no /metrics route
    metrics_token: str | None = None

    def __post_init__(self) -> None:
        self._tokens = [self.token.encode()] if self.token is not None else []
        self._metrics_tokens = [t.encode() for t in (self.token, self.metrics_token)
                                if t is not None]
        self.router = Router()
        self.router.add("GET", "/healthz", self.healthz)
        self.router.add("GET", "/admin/cache", self._guarded(self.stats))
        self.router.add("POST", "/admin/cache/purge", self._guarded(self.purge))
        if self.metrics is not None:
            self.router.add("GET", "/metrics", self._metrics_guarded(self.prometheus))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router.serve(scope, receive, send)

    def _guarded(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> None:
            self._check(request)
            await handler(request)

        return guarded

    def _check(self, request: Request) -> None:
        if self._tokens and not presents_token(request, self._tokens):
            raise AuthenticationFailed(
                "this is the gateway's admin API: send the admin token as "
                "'Authorization: Bearer <token>'", code="invalid_admin_token")

    def _metrics_guarded(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> None:
            if self._metrics_tokens and not presents_token(request, self._metrics_tokens):
                raise AuthenticationFailed(
                    "this is the gateway's /metrics: send the metrics token (or the admin "
                    "token) as 'Authorization: Bearer <token>'", code="invalid_metrics_token")
            await handler(request)

        return guarded

    async def healthz(self, request: Request) -> None:
        await send_json(request.send, 200, {"status": "ok"})

    async def prometheus(self, request: Request) -> None:
        assert self.metrics is not None
        await send_bytes(request.send, 200, await self.metrics(), content_type=CONTENT_TYPE)

    async def stats(self, request: Request) -> None:
        ready = bool(getattr(self.cache.embedder, "ready", True))
        state = "off" if not self.cache.wants_embedder() else "ready" if ready else "loading"
        body = {**self.cache.stats(), "semantic_cache": state, "semantic_ready": ready}
        await send_json(request.send, 200, body)

    async def purge(self, request: Request) -> None:
        raw = await request.body(MAX_BODY)
        try:
            asked = PurgeRequest.model_validate(orjson.loads(raw or b"{}"))
        except orjson.JSONDecodeError as error:
            raise InvalidRequest(f"body is not valid JSON: {error}") from None
        except ValidationError as error:
            raise InvalidRequest(f"invalid purge: {error.errors()[0]['msg']}") from None
        purged = await self.cache.purge(asked.tenant, asked.model, asked.key)
        log.info("cache purge tenant=%s model=%s key=%s: %d entries removed here",
                 asked.tenant, asked.model, asked.key, purged)
        await send_json(request.send, 200, {"purged": purged})


def purge(admin_url: str, token: str | None, *, tenant: str | None = None,
          model: str | None = None, key: str | None = None,
          timeout_s: float = 10.0, verify: ssl.SSLContext | bool = True) -> dict[str, Any]:
    """Ask one gateway's admin API to purge; its answer (raises ``httpx.HTTPError``).
    ``verify``: the admin's mutual-TLS client context for an https:// admin listener."""
    body = {k: v for k, v in {"tenant": tenant, "model": model, "key": key}.items()
            if v is not None}
    headers = {"authorization": f"Bearer {token}"} if token else {}
    reply = httpx.post(admin_url.rstrip("/") + "/admin/cache/purge", json=body,
                       headers=headers, timeout=timeout_s, verify=verify)
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:200]
        raise httpx.HTTPStatusError(f"{reply.status_code}: {message}", request=reply.request,
                                    response=reply)
    return dict(reply.json())


__all__ = ["GatewayAdmin", "PurgeRequest", "purge"]
