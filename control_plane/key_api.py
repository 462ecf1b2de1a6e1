"""Admin HTTP API of virtual keys: create, list, revoke; and the gateways' key secret.

    POST   /v1/keys             body: {tenant, name?, ttl_s? | expires_at?, models?,
                                 requests_per_s?, tokens_per_min?, budgets?: [{period,
                                 tokens | cost}]} → 201 {key, id, …, version}: the key,
                                 shown this once
    GET    /v1/keys             → {keys: [...]}: every key, never a secret nor a digest
    DELETE /v1/keys/{key_id}    → 200 {id, revoked: true, version} | 404
    GET    /v1/keys/secret      gateways only (their certificate): {secret: hex}

Each change is a new policy version (the keys block of ``policies.keys``,
``source`` "key create key_…" / "key revoke key_…"), so it reaches every
gateway on the policy watch, about a second, and shows in the policy
history. One change at a time on this replica (a lock around read, edit,
apply); two replicas changing keys in the same instant can lose one of the
two edits, which the answer's version lets an operator see.

The key secret is derived from the cluster CA's key: every replica sharing
the CA agrees on it and nothing new is stored. Without internal trust
(``--insecure-internal``) there is no secret to protect, and no virtual keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
from pydantic import ValidationError

from control_plane.admin_auth import ControlPlaneRoutes
from control_plane.policy_actor import Applied, ApplyPolicy, GetPolicy
from control_plane.policy_api import send_policy_error
from control_plane.policy_store import PolicyVersion
from hedgerow.actors import ActorRef
from hedgerow.asgi import Request, send_json
from hedgerow.errors import InvalidRequest, KeyNotFound
from policies.keys import derive_key_secret, key_digest, new_key, new_key_id, with_keys
from policies.schema import Budget, KeyLimits, PolicyError, VirtualKey

ASK_TIMEOUT_S = 5.0
MAX_BODY = 16 * 1024
MAX_TTL_S = 10 * 365 * 86400.0


@dataclass
class KeyApi:
    policies: ActorRef
    # The root the key secret is derived from (the trust book's MAC key); None:
    # --insecure-internal, no virtual keys.
    root_secret: bytes | None
    # Wall clock (epoch seconds): expiries are calendar times. Injected so the
    # key decisions below take ``now`` instead of reading it.
    clock: Callable[[], float] = time.time
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def secret(self) -> bytes:
        if self.root_secret is None:
            raise InvalidRequest("virtual keys need the control plane's internal trust (its "
                                 "cluster CA); it runs with --insecure-internal",
                                 code="keys_unavailable")
        return derive_key_secret(self.root_secret)

    def add_routes(self, routes: ControlPlaneRoutes) -> None:
        routes.admin("POST", "/v1/keys", self.create)
        routes.admin("GET", "/v1/keys", self.list_keys)
        routes.internal("GET", "/v1/keys/secret", self.send_secret, roles=("gateway",))
        routes.admin("DELETE", "/v1/keys/{key_id}", self.revoke)

    async def send_secret(self, request: Request) -> None:
        await send_json(request.send, 200, {"secret": self.secret.hex()},
                        [(b"cache-control", b"no-store")])

    async def create(self, request: Request) -> None:
        secret = self.secret
        asked = _json_object(await request.body(MAX_BODY))
        key_text = new_key()
        async with self._lock:
            current = await self._current()
            try:
                key = _new_key(asked, key_digest(secret, key_text), current, self.clock())
            except (ValidationError, ValueError, TypeError) as error:
                raise InvalidRequest(f"not a key: {_first_error(error)}") from None
            applied = await self._apply(request, current, [*current.policy.keys, key],
                                        f"key create {key.id}")
        if applied is None:
            return
        await send_json(request.send, 201, {"key": key_text, **_public(key),
                                            "version": applied.version.version},
                        [(b"cache-control", b"no-store")])

    async def list_keys(self, request: Request) -> None:
        current = await self._current()
        now = self.clock()
        await send_json(request.send, 200, {
            "version": current.version,
            "keys": [_public(key) | {"expired": key.expires_at is not None
                                     and now >= key.expires_at}
                     for key in current.policy.keys]})

    async def revoke(self, request: Request) -> None:
        wanted = request.path_params["key_id"]
        async with self._lock:
            current = await self._current()
            kept = [key for key in current.policy.keys if key.id != wanted]
            if len(kept) == len(current.policy.keys):
                raise KeyNotFound(f"no key {wanted[:64]!r} (see `hedgerow key list`)")
            applied = await self._apply(request, current, kept, f"key revoke {wanted}")
        if applied is not None:
            await send_json(request.send, 200, {"id": wanted, "revoked": True,
                                                "version": applied.version.version})

    async def _current(self) -> PolicyVersion:
        version: PolicyVersion = await self.policies.ask(GetPolicy(), timeout=ASK_TIMEOUT_S)
        return version

    async def _apply(self, request: Request, current: PolicyVersion, keys: list[VirtualKey],
                     source: str) -> Applied | None:
        text = with_keys(current.text, keys)
        try:
            applied: Applied = await self.policies.ask(ApplyPolicy(text, source),
                                                       timeout=ASK_TIMEOUT_S)
        except PolicyError as error:
            await send_policy_error(request, error)
            return None
        return applied


def _new_key(asked: dict[str, Any], digest: str, current: PolicyVersion,
             now: float) -> VirtualKey:
    unknown = set(asked) - {"tenant", "name", "ttl_s", "expires_at", "models",
                            "requests_per_s", "tokens_per_min", "budgets"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    for listed in ("models", "budgets"):
        if not isinstance(asked.get(listed) or [], list):
            raise ValueError(f"{listed} must be a list")
    tenant = asked.get("tenant")
    if not any(t.name == tenant for t in current.policy.tenants):
        names = ", ".join(t.name for t in current.policy.tenants) or "none"
        raise ValueError(f"tenant {tenant!r} is not in the policy (tenants: {names})")
    expires_at = asked.get("expires_at")
    if asked.get("ttl_s") is not None:
        ttl = asked["ttl_s"]
        # A JSON number, not a bool (float(True) is 1 s) or a string ("inf", "1e999").
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise ValueError("ttl_s must be a number of seconds")
        if not 0 < ttl <= MAX_TTL_S:
            raise ValueError("ttl_s must be between 0 and ten years")
        expires_at = now + ttl
    policy = current.policy
    models = tuple(dict.fromkeys(policy.canonical_model(str(m))
                                 for m in asked.get("models") or ()))
    return VirtualKey(
        id=new_key_id(), tenant=tenant, name=asked.get("name") or "", hmac_sha256=digest,
        created_at=round(now, 3), expires_at=expires_at, models=models,
        limits=KeyLimits(requests_per_s=asked.get("requests_per_s"),
                         tokens_per_min=asked.get("tokens_per_min")),
        budgets=tuple(Budget.model_validate(b) for b in asked.get("budgets") or ()))


def _public(key: VirtualKey) -> dict[str, Any]:
    """Everything about a key but its digest."""
    return key.model_dump(mode="json", exclude={"hmac_sha256"})


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError:
        raise InvalidRequest("expected a JSON object") from None
    if not isinstance(data, dict):
        raise InvalidRequest("expected a JSON object")
    return data


def _first_error(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return str(error)
