"""The policy schema: what an operator can tune, validated strictly.

Unknown keys are errors (a typo must never be silently ignored). The policy
issue grows this schema; the shipped default lives in ``default.yaml``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_POLICY_PATH = Path(__file__).with_name("default.yaml")


class PolicyError(ValueError):
    """A policy document that cannot be accepted; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    max_body_bytes: int = Field(1_048_576, ge=1024, le=64 * 1_048_576)
    max_messages: int = Field(256, ge=1, le=4096)
    max_tokens: int = Field(4096, ge=1)


class PriorityClass(_Strict):
    name: str
    ttft_slo_ms: int = Field(ge=1)
    deadline_ms: int = Field(ge=1)
    # Hedge requests of this class when their first token is late.
    hedge: bool = True


class TenantLimits(_Strict):
    requests_per_s: float = Field(50.0, gt=0)
    requests_burst: int = Field(100, ge=1)
    tokens_per_min: float = Field(1_000_000.0, gt=0)
    tokens_burst: int = Field(200_000, ge=1)
    max_concurrency: int = Field(64, ge=1)


class Tenant(_Strict):
    name: str
    # The policy never holds raw keys: sha256 hex digests of "Bearer" tokens.
    api_key_sha256: tuple[str, ...] = ()
    class_: str = Field("interactive", alias="class")
    limits: TenantLimits = TenantLimits()


class Scheduling(_Strict):
    # Requests waiting for a worker slot, all models together; beyond it: 503.
    max_queue: int = Field(1024, ge=1)
    # Refuse at once when predicted queue wait + prefill exceeds the deadline.
    slo_admission: bool = True
    # "edf" (earliest deadline first) or "fifo" (arrival order; for comparison).
    order: str = Field("edf", pattern="^(edf|fifo)$")
    # Prefill estimate used until workers have measured themselves.
    prefill_ms_per_token: float = Field(0.5, ge=0)


class Timeouts(_Strict):
    connect_ms: int = Field(2000, ge=1)
    ttft_ms: int = Field(30000, ge=1)
    idle_ms: int = Field(30000, ge=1)


class Retries(_Strict):
    # Attempts on other workers when one fails before the first token.
    before_first_token: int = Field(1, ge=0, le=3)


class Hedging(_Strict):
    enabled: bool = True
    quantile: float = Field(0.95, gt=0, lt=1)
    floor_ms: int = Field(50, ge=0)
    ceiling_ms: int = Field(5000, ge=1)
    budget_ratio: float = Field(0.05, ge=0, le=1)
    budget_burst: float = Field(5.0, ge=1)  # whole hedges; turn hedging off with enabled
    min_samples: int = Field(20, ge=1)

    @model_validator(mode="after")
    def _floor_below_ceiling(self) -> Hedging:
        if self.floor_ms > self.ceiling_ms:
            raise ValueError("hedging.floor_ms must not exceed hedging.ceiling_ms")
        return self


class Breaker(_Strict):
    failures_to_open: int = Field(3, ge=1)
    open_for_ms: int = Field(2000, ge=1)
    max_open_for_ms: int = Field(30000, ge=1)

    @model_validator(mode="after")
    def _open_below_max(self) -> Breaker:
        if self.open_for_ms > self.max_open_for_ms:
            raise ValueError("breaker.open_for_ms must not exceed breaker.max_open_for_ms")
        return self


class Routing(_Strict):
    prefer_gpu_above_tokens: int = Field(512, ge=0)
    allow_cpu_fallback: bool = True


class ModelEntry(_Strict):
    name: str
    aliases: tuple[str, ...] = ()


class Policy(_Strict):
    limits: Limits = Limits()
    scheduling: Scheduling = Scheduling()
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    hedging: Hedging = Hedging()
    breaker: Breaker = Breaker()
    routing: Routing = Routing()
    anonymous_tenant: str | None = None
    classes: tuple[PriorityClass, ...] = ()
    tenants: tuple[Tenant, ...] = ()
    models: tuple[ModelEntry, ...] = ()

    @model_validator(mode="after")
    def _references_resolve(self) -> Policy:
        tenant_names = {t.name for t in self.tenants}
        class_names = {c.name for c in self.classes}
        if self.anonymous_tenant is not None and self.anonymous_tenant not in tenant_names:
            raise ValueError(f"anonymous_tenant {self.anonymous_tenant!r} is not a tenant")
        for tenant in self.tenants:
            if tenant.class_ not in class_names:
                raise ValueError(f"tenant {tenant.name!r} uses unknown class {tenant.class_!r}")
        return self

    def tenant(self, name: str) -> Tenant:
        return next(t for t in self.tenants if t.name == name)

    def priority_class(self, name: str) -> PriorityClass:
        return next(c for c in self.classes if c.name == name)

    def canonical_model(self, requested: str) -> str:
        """Map an alias to its model name; unknown names pass through unchanged."""
        for entry in self.models:
            if requested == entry.name or requested in entry.aliases:
                return entry.name
        return requested

    def declares_model(self, name: str) -> bool:
        return any(entry.name == name for entry in self.models)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        data: Any = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise PolicyError(f"{source}: YAML syntax error: {error}") from None
    try:
        return Policy.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise PolicyError(f"{source}: {where}: {first['msg']}") from None


def load_policy(path: Path = DEFAULT_POLICY_PATH) -> Policy:
    return parse_policy(path.read_text(), str(path))
