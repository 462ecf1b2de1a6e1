"""HTTP API of internal trust.

On the join listener (``--join-port``; TLS with the control plane's
certificate, no client certificate asked — a joiner has none yet)::

    GET  /healthz          liveness, for probes that hold no certificate
    GET  /v1/ca            the cluster CA (PEM): a joiner checks it against its --ca-pin
    POST /v1/join          {token, name, csr} → 201 {identity, certificate, ca, not_after}

On the main listener (mutual TLS)::

    POST /v1/certificates/renew      {csr} → 201 a fresh certificate for the caller's identity
    POST   /v1/tokens                admin: {role, ttl_s?, name?, description?} → 201 {token, ...}
    GET    /v1/tokens                admin: every token, without secrets
    DELETE /v1/tokens/{token_id}     admin: revoke it and every identity it bought
    POST   /v1/identities/revoke     admin: {identity: "worker/cpu-1"}
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from control_plane.bodies import parse_body
from control_plane.trust_service import ANY_ROLE, TrustService
from hedgerow.asgi import Request, Router, Scope, Receive, Send, send_bytes, send_json
from hedgerow.errors import Conflict, InvalidRequest, PermissionDenied, AuthenticationFailed, \
    UnknownWorker
from hedgerow.trust.ca import CaError
from hedgerow.trust.identity import Identity, IdentityError
from hedgerow.trust.peer import PEER
from hedgerow.trust.tokens import DEFAULT_TTL_S, JoinRefused

MAX_BODY = 16 * 1024

Evict = Callable[[Identity], Awaitable[None]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JoinBody(_Body):
    token: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1, max_length=128)
    csr: str = Field(min_length=1, max_length=8192)


class RenewBody(_Body):
    csr: str = Field(min_length=1, max_length=8192)


class TokenBody(_Body):
    role: str
    ttl_s: float = DEFAULT_TTL_S
    name: str | None = None
    description: str = Field("", max_length=200)


class RevokeBody(_Body):
    identity: str = Field(min_length=1, max_length=200)


@dataclass
class TrustApi:
    trust: TrustService
    evict: Evict  # takes a revoked identity out of service (a worker leaves the registry)

    def join_app(self) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        router = Router()
        router.add("GET", "/healthz", self.healthz)
        router.add("GET", "/v1/ca", self.ca)
        router.add("POST", "/v1/join", self.join)
        return router.serve

    def add_routes(self, routes: Any) -> None:
        routes.internal("POST", "/v1/certificates/renew", self.renew,
                        roles=("gateway", "worker", "admin"))
        routes.admin("POST", "/v1/tokens", self.create_token)
        routes.admin("GET", "/v1/tokens", self.list_tokens)
        routes.admin("DELETE", "/v1/tokens/{token_id}", self.revoke_token)
        routes.admin("POST", "/v1/identities/revoke", self.revoke_identity)

    async def healthz(self, request: Request) -> None:
        await send_json(request.send, 200, {"status": "ok"})

    async def ca(self, request: Request) -> None:
        await send_bytes(request.send, 200, self.trust.ca.pem,
                         content_type=b"application/x-pem-file")

    async def join(self, request: Request) -> None:
        body = await parse_body(request, JoinBody, "join request", limit=MAX_BODY)
        await self.trust.refresh()  # a token may have been made through another replica
        with _refusals():
            issued = self.trust.join(body.token, body.name, body.csr.encode())
        await self.trust.flush()
        await send_json(request.send, 201, issued.json())

    async def renew(self, request: Request) -> None:
        body = await parse_body(request, RenewBody, "renewal", limit=MAX_BODY)
        await self.trust.refresh()  # a revocation made through another replica counts
        self.trust.caller(("gateway", "worker", "admin"))  # checked again after it
        peer = PEER.get()
        assert peer is not None  # the route's role check passed
        with _refusals():
            issued = self.trust.renew(peer, body.csr.encode())
        await self.trust.flush()
        await send_json(request.send, 201, issued.json())

    async def create_token(self, request: Request) -> None:
        body = await parse_body(request, TokenBody, "token request", limit=MAX_BODY)
        try:
            text, record = self.trust.create_token(
                body.role, ttl_s=body.ttl_s, name=body.name,
                description=body.description)
        except ValueError as error:
            raise InvalidRequest(str(error), code="invalid_token_request") from None
        await self.trust.flush()
        await send_json(request.send, 201, {"token": text, **record})

    async def list_tokens(self, request: Request) -> None:
        await self.trust.refresh()
        tokens = [t.public() for t in self.trust.book.tokens.values()]
        holders = {k: vars(h) for k, h in self.trust.book.holders.items()}
        await send_json(request.send, 200, {"tokens": tokens, "holders": holders,
                                            "revoked": self.trust.book.revoked})

    async def revoke_token(self, request: Request) -> None:
        token_id = request.path_params["token_id"]
        try:
            identities = self.trust.revoke_token(token_id)
        except KeyError:
            raise UnknownWorker(f"no join token {token_id!r}", code="unknown_token") from None
        await self.trust.flush()
        for identity in identities:
            await self.evict(identity)
        await send_json(request.send, 200, {"token_id": token_id, "revoked": True,
                                            "identities": [str(i) for i in identities]})

    async def revoke_identity(self, request: Request) -> None:
        body = await parse_body(request, RevokeBody, "revocation", limit=MAX_BODY)
        try:
            identity = Identity.parse(body.identity)
        except IdentityError as error:
            raise InvalidRequest(str(error), code="invalid_identity") from None
        self.trust.revoke_identity(identity)
        await self.trust.flush()
        await self.evict(identity)
        await send_json(request.send, 200, {"identity": str(identity), "revoked": True})


class _refusals:
    """JoinRefused and CaError become the one error hierarchy's statuses."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if isinstance(error, JoinRefused):
            if error.status == 401:
                raise AuthenticationFailed(str(error), code="invalid_join_token") from None
            if error.status == 409:
                raise Conflict(str(error), code="identity_in_use") from None
            if error.status == 403:
                raise PermissionDenied(str(error), code="join_refused") from None
            raise InvalidRequest(str(error), code="invalid_join") from None
        if isinstance(error, CaError):
            raise InvalidRequest(str(error), code="invalid_csr") from None


__all__ = ["ANY_ROLE", "TrustApi"]
