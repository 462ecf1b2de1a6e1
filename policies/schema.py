"""The policy schema: what an operator can tune, validated strictly.

Unknown keys are errors (a typo must never be silently ignored). Rules that
span fields (references, duplicate names) raise ``SchemaRuleError`` carrying
the location of each violation, so the loader (``policies/loader.py``) can
point at the exact line. The shipped default lives in ``default.yaml``.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from hedgerow.errors import InvalidRequest

DEFAULT_POLICY_PATH = Path(__file__).with_name("default.yaml")

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class PolicyIssue:
    """One reason a policy document was rejected, and where it was written."""

    source: str
    line: int  # 1-based
    column: int  # 1-based
    path: str  # e.g. "tenants[1].limits.max_concurrency"; "(document)" for the whole
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}:{self.column}: {self.path}: {self.message}"


class PolicyError(InvalidRequest):
    """A policy document that cannot be accepted; one line per issue, each
    ``file:line:column: path: message``."""

    default_code = "invalid_policy"

    def __init__(self, issues: Sequence[PolicyIssue], omitted: int = 0) -> None:
        if not issues:
            raise ValueError("a PolicyError needs at least one issue")
        self.issues = tuple(issues)
        self.omitted = omitted
        lines = [str(issue) for issue in self.issues]
        if omitted:
            lines.append(f"(and {omitted} more problems)")
        super().__init__("\n".join(lines))


class SchemaRuleError(ValueError):
    """Cross-field violations, each with its location relative to the model."""

    def __init__(self, violations: Sequence[tuple[Loc, str]]) -> None:
        self.violations = tuple(violations)
        super().__init__("; ".join(message for _, message in self.violations))


def _raise_violations(violations: Sequence[tuple[Loc, str]]) -> None:
    if violations:
        raise SchemaRuleError(violations)


_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def _sha256_digest(value: str) -> str:
    if not _SHA256_HEX.fullmatch(value):
        raise ValueError(
            "must be the sha256 hex digest of an API key (64 hex characters), never the key "
            "itself; compute it with: printf %s KEY | sha256sum")
    return value.lower()


ApiKeyDigest = Annotated[str, AfterValidator(_sha256_digest)]
Name = Annotated[str, Field(min_length=1, max_length=128)]


class _Strict(BaseModel):
    # No inf/nan: a rate of .inf is a typo, not a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Limits(_Strict):
    max_body_bytes: int = Field(1_048_576, ge=1024, le=64 * 1_048_576)
    max_messages: int = Field(256, ge=1, le=4096)
    max_tokens: int = Field(4096, ge=1)


class PriorityClass(_Strict):
    name: Name
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
    name: Name
    # The policy never holds raw keys: sha256 hex digests of "Bearer" tokens.
    api_key_sha256: tuple[ApiKeyDigest, ...] = ()
    class_: str = Field("interactive", alias="class")
    limits: TenantLimits = TenantLimits()


class Scheduling(_Strict):
    # Requests waiting for a worker slot, all models together; beyond it: 503.
    max_queue: int = Field(1024, ge=1)
    # Refuse at once when predicted queue wait + prefill exceeds the deadline.
    slo_admission: bool = True
    # "edf" (earliest deadline first) or "fifo" (arrival order; for comparison).
    order: Literal["edf", "fifo"] = "edf"
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
            raise SchemaRuleError([(("floor_ms",), "must not exceed hedging.ceiling_ms")])
        return self


class Breaker(_Strict):
    failures_to_open: int = Field(3, ge=1)
    open_for_ms: int = Field(2000, ge=1)
    max_open_for_ms: int = Field(30000, ge=1)

    @model_validator(mode="after")
    def _open_below_max(self) -> Breaker:
        if self.open_for_ms > self.max_open_for_ms:
            raise SchemaRuleError([(("open_for_ms",), "must not exceed breaker.max_open_for_ms")])
        return self


class Routing(_Strict):
    prefer_gpu_above_tokens: int = Field(512, ge=0)
    allow_cpu_fallback: bool = True


class ModelEntry(_Strict):
    name: Name
    aliases: tuple[Name, ...] = ()


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")) or len(value) > 512:
        raise ValueError("must be an http:// or https:// URL (at most 512 characters)")
    return value.rstrip("/")


def _env_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
        raise ValueError("must be the NAME of an environment variable holding the key "
                         "(letters, digits, _), never the key itself")
    return value


def _absolute_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must start with /")
    return value


class Upstream(_Strict):
    """An OpenAI-compatible server that sends no heartbeats (llama-server, vLLM,
    another Hedgerow): the control plane probes it and lists it while healthy."""

    name: Name  # its worker id in the registry
    url: Annotated[str, AfterValidator(_http_url)]  # base URL; /v1/... is appended
    models: tuple[Name, ...] = Field(min_length=1, max_length=64)  # as clients name them
    # Client name → the upstream's own name, where they differ.
    model_map: dict[Name, Name] = Field(default_factory=dict)
    slots: int = Field(1, ge=1, le=1024)
    kind: Literal["cpu", "gpu"] = "cpu"
    labels: dict[Name, str] = Field(default_factory=dict)
    # Name of an env var holding the bearer key; each process reads its own.
    api_key_env: Annotated[str, AfterValidator(_env_name)] | None = None
    health_path: Annotated[str, AfterValidator(_absolute_path)] = "/v1/models"
    probe_interval_ms: int = Field(2000, ge=100, le=600_000)
    probe_timeout_ms: int = Field(1000, ge=10, le=5000)

    @model_validator(mode="after")
    def _mapped_models_are_served(self) -> Upstream:
        _raise_violations([
            (("model_map", name), f"model_map renames {name!r}, which is not in models")
            for name in self.model_map if name not in self.models])
        return self


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
    upstreams: tuple[Upstream, ...] = ()

    @model_validator(mode="after")
    def _names_unique_and_references_resolve(self) -> Policy:
        _raise_violations([
            *_duplicates("classes", (c.name for c in self.classes), "class"),
            *_duplicates("tenants", (t.name for t in self.tenants), "tenant"),
            *_duplicates("models", (m.name for m in self.models), "model"),
            *_duplicates("upstreams", (u.name for u in self.upstreams), "upstream"),
            *_dangling_references(self),
            *_shared_api_keys(self.tenants),
            *_shadowing_aliases(self.models),
        ])
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


Violations = list[tuple[Loc, str]]


def _duplicates(section: str, names: Iterable[str], kind: str) -> Violations:
    seen: dict[str, int] = {}
    found: Violations = []
    for index, name in enumerate(names):
        if name in seen:
            found.append(((section, index, "name"),
                          f"duplicate {kind} name {name!r} (also {section}[{seen[name]}])"))
        seen.setdefault(name, index)
    return found


def _dangling_references(policy: Policy) -> Violations:
    tenant_names = [t.name for t in policy.tenants]
    class_names = [c.name for c in policy.classes]
    found: Violations = []
    if policy.anonymous_tenant is not None and policy.anonymous_tenant not in tenant_names:
        found.append((("anonymous_tenant",), f"anonymous_tenant {policy.anonymous_tenant!r} "
                      f"is not a tenant (tenants: {_listing(tenant_names)})"))
    for index, tenant in enumerate(policy.tenants):
        if tenant.class_ not in class_names:
            found.append((("tenants", index, "class"), f"tenant {tenant.name!r} uses unknown "
                          f"class {tenant.class_!r} (classes: {_listing(class_names)})"))
    return found


def _shared_api_keys(tenants: Sequence[Tenant]) -> Violations:
    """One key must identify one tenant; a digest listed twice is ambiguous."""
    counts = Counter(digest for t in tenants for digest in t.api_key_sha256)
    return [
        (("tenants", ti, "api_key_sha256", ki), "this key digest is listed more than once")
        for ti, tenant in enumerate(tenants)
        for ki, digest in enumerate(tenant.api_key_sha256)
        if counts[digest] > 1
    ]


def _shadowing_aliases(models: Sequence[ModelEntry]) -> Violations:
    """An alias must name exactly one model: never another model's name or alias."""
    owners: dict[str, int] = {m.name: i for i, m in enumerate(models)}
    found: Violations = []
    for mi, model in enumerate(models):
        for ai, alias in enumerate(model.aliases):
            owner = owners.setdefault(alias, mi)
            if owner != mi or alias == model.name:
                found.append((("models", mi, "aliases", ai),
                              f"alias {alias!r} already names model {models[owner].name!r}"))
    return found


def _listing(names: Sequence[str]) -> str:
    return ", ".join(dict.fromkeys(names)) if names else "none declared"


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Parse and validate a YAML policy; ``PolicyError`` lists every problem."""
    from policies.loader import parse_policy_document  # the loader builds on this module

    return parse_policy_document(text, source)


def load_policy(path: Path = DEFAULT_POLICY_PATH) -> Policy:
    return parse_policy(path.read_text(), str(path))
