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

from hedgerow.endpoints import parse_endpoint
from hedgerow.errors import InvalidRequest

DEFAULT_POLICY_PATH = Path(__file__).with_name("default.yaml")
# Cached questions the semantic cache's pair model may judge for one lookup
# (also the embedding sidecar's bound on a judge request).
MAX_SEMANTIC_CANDIDATES = 8

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
    # Characters of text in one message (or a completion's prompt), and in all
    # of a request's messages together (about four characters a token).
    max_message_chars: int = Field(262_144, ge=1)
    max_prompt_chars: int = Field(524_288, ge=1)
    max_tokens: int = Field(4096, ge=1)


class PriorityClass(_Strict):
    name: Name
    ttft_slo_ms: int = Field(ge=1)
    deadline_ms: int = Field(ge=1)
    # Hedge requests of this class when their first token is late.
    hedge: bool = True
    # The largest max_tokens this class may ask for (never above limits.max_tokens).
    max_tokens: int | None = Field(None, ge=1)
    # Quantization tier (workers labelled tier=NAME, `hedgerow worker --tier`) this
    # class prefers, e.g. fast for interactive, accurate for premium. Soft: other
    # workers still serve it when none of the tier has room. None: any worker.
    tier: Name | None = None


class TenantLimits(_Strict):
    requests_per_s: float = Field(50.0, gt=0)
    requests_burst: int = Field(100, ge=1)
    tokens_per_min: float = Field(1_000_000.0, gt=0)
    tokens_burst: int = Field(200_000, ge=1)
    max_concurrency: int = Field(64, ge=1)


class Budget(_Strict):
    """What a tenant or a key may spend per calendar period (UTC): tokens, or cost
    in the currency of the models' ``price_per_million_tokens``. Enforced by
    ``policies.budget`` (reserve at admission, settle with the usage)."""

    period: Literal["day", "month"]
    tokens: int | None = Field(None, ge=1)
    cost: float | None = Field(None, gt=0, le=1e12)

    @model_validator(mode="after")
    def _one_measure(self) -> Budget:
        if (self.tokens is None) == (self.cost is None):
            raise ValueError("a budget sets exactly one of tokens or cost")
        return self


class KeyLimits(_Strict):
    """A virtual key's own rates, on top of its tenant's (None: only the tenant's)."""

    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(None, gt=0)


_KEY_ID = r"key_[0-9a-z]{8,32}"


class VirtualKey(_Strict):
    """An API key made by ``hedgerow key create``: the key itself is never stored,
    only its HMAC-SHA256 under the cluster's key secret (``policies.keys``)."""

    id: Annotated[str, Field(pattern=_KEY_ID)]
    tenant: Name
    name: Annotated[str, Field(max_length=128)] = ""
    hmac_sha256: Annotated[str, Field(pattern=r"[0-9a-f]{64}")]
    created_at: float = Field(ge=0)
    expires_at: float | None = Field(None, ge=0)  # seconds since the epoch; None: never
    models: tuple[Name, ...] = ()  # canonical model names it may use; empty: every model
    limits: KeyLimits = KeyLimits()
    budgets: tuple[Budget, ...] = ()


class Tenant(_Strict):
    name: Name
    # The policy never holds raw keys: sha256 hex digests of "Bearer" tokens.
    api_key_sha256: tuple[ApiKeyDigest, ...] = ()
    class_: str = Field("interactive", alias="class")
    limits: TenantLimits = TenantLimits()
    budgets: tuple[Budget, ...] = ()


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
    # A client's request body, from the end of its headers: later, 408 and
    # (HTTP/1.1) the connection closed, so a trickled body cannot hold it.
    body_ms: int = Field(10_000, ge=100, le=600_000)


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


class Streams(_Strict):
    """Resumable SSE streams: what the gateway keeps so a client can reconnect."""

    # After the last client of a started stream leaves, the generation runs on
    # this long waiting for a resume (GET .../events with Last-Event-ID); 0
    # stops the worker at once when the client goes.
    resume_grace_ms: int = Field(5000, ge=0, le=600_000)
    # A finished stream stays resumable this long.
    retain_ms: int = Field(60_000, ge=0, le=3_600_000)
    # Events kept per stream; older ones are dropped (a resume from before them
    # gets 410, a reader that fell that far behind gets an error event).
    max_buffer_bytes: int = Field(1_048_576, ge=4096, le=64 * 1_048_576)
    # All streams' buffers together; finished streams are evicted first.
    max_total_bytes: int = Field(64 * 1_048_576, ge=65_536, le=4096 * 1_048_576)
    max_streams: int = Field(10_000, ge=1, le=1_000_000)
    # An SSE comment on a stream idle this long keeps proxies and NATs from closing it.
    heartbeat_ms: int = Field(15_000, ge=100, le=600_000)
    # A client that accepts no bytes for this long is cut (with an error event queued).
    write_stall_ms: int = Field(30_000, ge=100, le=600_000)


_ORIGIN = re.compile(r"https?://([a-z0-9-]+(\.[a-z0-9-]+)*|\[[0-9a-f:.]+\])(:[0-9]{1,5})?")
_HEADER_NAME = re.compile(r"[!#$%&'+.^_`|~0-9a-z-]+")  # an RFC 9110 token, lowercase, no *
_METHOD = re.compile(r"[A-Z]+")


def _origin(value: str) -> str:
    if value != "*" and not _ORIGIN.fullmatch(value):
        raise ValueError("must be '*' or an origin as browsers send it: scheme://host[:port], "
                         "lowercase, no path or trailing slash (e.g. https://app.example.com)")
    return value


def _header_name(value: str) -> str:
    value = value.lower()
    if not _HEADER_NAME.fullmatch(value):
        raise ValueError("must be a header name (no '*': list the headers)")
    return value


def _method(value: str) -> str:
    if not _METHOD.fullmatch(value):
        raise ValueError("must be an HTTP method in capitals, e.g. POST")
    return value


class Cors(_Strict):
    """Which browser origins may call the API from their own pages (CORS).

    Empty ``allow_origins`` (the default) admits no other origin: the chat
    page at ``/`` is same-origin and needs none.
    """

    allow_origins: tuple[Annotated[str, AfterValidator(_origin)], ...] = Field(
        (), max_length=256)
    allow_methods: tuple[Annotated[str, AfterValidator(_method)], ...] = Field(
        ("GET", "POST"), min_length=1, max_length=16)
    allow_headers: tuple[Annotated[str, AfterValidator(_header_name)], ...] = Field(
        ("authorization", "content-type", "last-event-id", "x-hedgerow-deadline-ms"),
        max_length=64)
    expose_headers: tuple[Annotated[str, AfterValidator(_header_name)], ...] = Field(
        ("x-request-id", "x-hedgerow-worker", "x-hedgerow-cache", "x-hedgerow-hedged",
         "retry-after"), max_length=64)
    # Cookies / Authorization sent by a browser with credentials: "include".
    allow_credentials: bool = False
    max_age_s: int = Field(600, ge=0, le=86_400)  # how long browsers cache a preflight

    @model_validator(mode="after")
    def _wildcard_rules(self) -> Cors:
        found: Violations = []
        if "*" in self.allow_origins and len(self.allow_origins) > 1:
            found.append((("allow_origins",), "'*' admits every origin; list no others with it"))
        if "*" in self.allow_origins and self.allow_credentials:
            found.append((("allow_credentials",), "cannot be true with allow_origins '*': "
                          "browsers refuse credentials for a wildcard; list the origins"))
        _raise_violations(found)
        return self


class ModelPrice(_Strict):
    """What a million tokens of a model cost, in one currency the operator picks
    (the same for every model): the gateways' ``hedgerow_tenant_cost_total``."""

    input: float = Field(ge=0, le=1_000_000)  # prompt tokens a worker computed
    output: float = Field(ge=0, le=1_000_000)  # completion tokens
    # Tokens of answers served without a worker (cache hits, single-flight joins).
    cached: float = Field(0.0, ge=0, le=1_000_000)


class ModelEntry(_Strict):
    name: Name
    aliases: tuple[Name, ...] = ()
    # Part of every cache key: changing it invalidates the model's cached answers.
    version: Annotated[str, Field(min_length=1, max_length=64)] = "1"
    # None: the model's tokens are counted but not priced.
    price_per_million_tokens: ModelPrice | None = None


class ExactCache(_Strict):
    enabled: bool = True
    ttl_s: float = Field(3600.0, gt=0, le=30 * 86400)
    max_entries: int = Field(10_000, ge=1)  # in-process; Redis is bounded by TTL
    max_bytes: int = Field(64 * 1_048_576, ge=1024)


class SemanticCache(_Strict):
    # Off unless a policy turns it on: it runs a sidecar process with two
    # models (~310 MB resident at its start, more under load) and adds
    # ~45-50 ms of judging to each miss whose namespace holds entries.
    enabled: bool = False
    # Who decides that a cached question asks what a new one asks:
    # ``pair_model``, MiniLM fine-tuned to read both questions together
    # (gateway.cache.pair_model), or ``cosine``, the embeddings' cosine with
    # ``threshold`` and the guards (the design before 2026-12-04; on questions
    # it was never tuned on, about one hit in four was wrong).
    judge: Literal["pair_model", "cosine"] = "pair_model"
    # The pair model's score (0..1, the lower of both orders) a hit needs.
    # A wrong hit serves another question's answer; a miss costs one
    # generation. 0.99 by the rule committed before it was applied (712de94;
    # docs/benchmarks.md, "Negatives as the cache meets them"): the highest
    # recall on the development set (sealed4) with every question cached at
    # once among the points whose precision there is >= 0.97 (0.981, finding
    # 26 % of its paraphrases). As the cache runs on the sets nobody tuned on:
    # sealed5 0.985 / 0.333, sealed6 0.993 / 0.383. Lower finds more and is
    # wrong more often (0.5: sealed5 0.877 / 0.612, one hit in eight wrong).
    # A question typed as a cached one is (gateway.cache.semantic.typing_key)
    # hits whatever this says.
    pair_threshold: float = Field(0.99, gt=0, lt=1)
    # How many nearest cached questions the pair model reads, and the cosine a
    # cached question needs to be one of them (a bound on the model's work; at
    # 0.3 the training sets lose 0-2.4 % of their paraphrases, at 0.5 up to 14 %).
    max_candidates: int = Field(4, ge=1, le=MAX_SEMANTIC_CANDIDATES)
    candidate_floor: float = Field(0.3, ge=-1, le=1)
    # judge: cosine -- the cosine similarity a cached question needs (and the
    # guards must agree too); 0.68 was chosen with the guards on first +
    # holdout_dev (docs/benchmarks.md).
    threshold: float = Field(0.68, gt=0, le=1)
    max_entries_per_namespace: int = Field(5000, ge=1)
    max_namespaces: int = Field(10_000, ge=1)
    ttl_s: float = Field(3600.0, gt=0, le=30 * 86400)
    hnsw_above: int = Field(2000, ge=1)  # flat (exact) search below, HNSW above


class SharedNamespace(_Strict):
    """Tenants that read and write one common cache namespace."""

    name: Name
    tenants: tuple[Name, ...] = Field(min_length=1)


class Cache(_Strict):
    enabled: bool = True
    exact: ExactCache = ExactCache()
    semantic: SemanticCache = SemanticCache()
    # A slower Redis call counts as a fault: served as a miss, from local memory.
    redis_timeout_ms: int = Field(50, ge=1, le=5000)
    redis_retry_after_s: float = Field(5.0, gt=0, le=600)
    # Cache only temperature-0 or fixed-seed requests, except for these opt-ins.
    deterministic_only: bool = True
    opt_in_tenants: tuple[Name, ...] = ()
    opt_in_models: tuple[Name, ...] = ()
    shared_namespaces: tuple[SharedNamespace, ...] = ()

    @property
    def semantic_on(self) -> bool:
        """Both the cache and its semantic part on: the embedding model runs."""
        return self.enabled and self.semantic.enabled

    @model_validator(mode="after")
    def _tenant_in_one_namespace(self) -> Cache:
        seen: set[str] = set()
        found: Violations = []
        for gi, group in enumerate(self.shared_namespaces):
            for ti, tenant in enumerate(group.tenants):
                if tenant in seen:
                    found.append((("shared_namespaces", gi, "tenants", ti),
                                  f"tenant {tenant!r} is in more than one shared namespace"))
                seen.add(tenant)
        _raise_violations(found)
        return self

    def namespace_of(self, tenant: str) -> str:
        """The cache namespace ``tenant`` reads and writes: its own unless shared."""
        for group in self.shared_namespaces:
            if tenant in group.tenants:
                return f"shared:{group.name}"
        return f"tenant:{tenant}"


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _http_url(value: str) -> str:
    # The parser the gateway builds request URLs with: what passes here, it can call.
    parse_endpoint(value, strict=False)
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
    models: tuple[Name, ...] = Field((), max_length=64)  # as clients name them
    # Models it serves for POST /v1/embeddings (as clients name them); not chat.
    embedding_models: tuple[Name, ...] = Field((), max_length=64)
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
            (("model_map", name), f"model_map renames {name!r}, which is not in models "
             "or embedding_models")
            for name in self.model_map
            if name not in self.models and name not in self.embedding_models]
            + [(("models",), "an upstream serves at least one model (models or "
                "embedding_models)")] * (not self.models and not self.embedding_models))
        return self


class Pop(_Strict):
    """One point of presence: a gateway and its nearby workers (label ``pop=NAME``)."""

    name: Name
    region: Name
    # Where this PoP's gateway spills, in order, when its own workers cannot
    # take a request soon enough; PoPs not listed follow, nearest (RTT) first.
    prefer: tuple[Name, ...] = ()


class Topology(_Strict):
    """Where gateways and workers are, and what a WAN round trip costs.

    A gateway's own PoP comes from ``hedgerow gateway --pop NAME``; a worker's
    from its ``pop`` label (``hedgerow worker --label pop=NAME``). Workers
    without one count as local to every gateway.
    """

    # local_first: prefer the gateway's own PoP (see policies/locality.py);
    # blind: ignore PoPs (the old behaviour, kept for comparison);
    # local_only: never leave the gateway's PoP (each PoP on its own, for comparison).
    routing: Literal["local_first", "blind", "local_only"] = "local_first"
    pops: tuple[Pop, ...] = ()
    # Round-trip times between PoPs, either direction: {ams: {fra: 12}}.
    rtt_ms: dict[Name, dict[Name, float]] = Field(default_factory=dict)
    default_rtt_ms: float = Field(50.0, ge=0, le=60_000)  # pairs rtt_ms does not list
    # Spill only when it wins by at least this much (hysteresis against flapping).
    spill_margin_ms: float = Field(0.0, ge=0, le=60_000)
    # A hedge may cross PoPs only when the hedge budget holds this many whole
    # hedges (one stays for a local hedge) and the deadline leaves room.
    cross_pop_hedge_min_budget: float = Field(2.0, ge=1)

    @model_validator(mode="after")
    def _references_resolve(self) -> Topology:
        _raise_violations(_topology_violations(self))
        return self


def _topology_violations(topology: Topology) -> list[tuple[Loc, str]]:
    names = [p.name for p in topology.pops]
    found: list[tuple[Loc, str]] = list(_duplicates("pops", names, "pop"))
    known = set(names)
    for pi, pop in enumerate(topology.pops):
        for qi, other in enumerate(pop.prefer):
            if other == pop.name or other not in known or other in pop.prefer[:qi]:
                found.append((("pops", pi, "prefer", qi), f"pop {pop.name!r} cannot prefer "
                              f"{other!r} (pops: {_listing(names)}; not itself, once each)"))
    seen: dict[frozenset[str], float] = {}
    for a, row in topology.rtt_ms.items():
        for b, rtt in row.items():
            problem = _rtt_problem(a, b, rtt, known, seen)
            if problem:
                found.append((("rtt_ms", a, b), problem))
            seen.setdefault(frozenset((a, b)), rtt)
    return found


def _rtt_problem(a: str, b: str, rtt: float, known: set[str],
                 seen: dict[frozenset[str], float]) -> str | None:
    if a not in known or b not in known:
        return f"rtt_ms names an unknown pop ({a!r} or {b!r}); declare it under pops"
    if a == b:
        return "a pop has no round trip to itself"
    if not 0 <= rtt <= 60_000:
        return "must be between 0 and 60000 ms"
    if seen.get(frozenset((a, b)), rtt) != rtt:
        return f"rtt between {a!r} and {b!r} is given twice with different values"
    return None


class Policy(_Strict):
    limits: Limits = Limits()
    scheduling: Scheduling = Scheduling()
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    hedging: Hedging = Hedging()
    breaker: Breaker = Breaker()
    routing: Routing = Routing()
    cors: Cors = Cors()
    streams: Streams = Streams()
    anonymous_tenant: str | None = None
    classes: tuple[PriorityClass, ...] = ()
    tenants: tuple[Tenant, ...] = ()
    models: tuple[ModelEntry, ...] = ()
    upstreams: tuple[Upstream, ...] = ()
    topology: Topology = Field(default_factory=lambda: Topology())
    cache: Cache = Cache()
    # Virtual keys (``hedgerow key create``), kept in a block at the end of the text.
    keys: tuple[VirtualKey, ...] = ()

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
            *_virtual_key_rules(self),
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

    def model_price(self, name: str) -> ModelPrice | None:
        """The price of model ``name`` (canonical), None when the policy sets none."""
        return next((m.price_per_million_tokens for m in self.models if m.name == name), None)

    def model_version(self, name: str) -> str:
        """The policy's version of model ``name`` (canonical), "1" if undeclared."""
        return next((m.version for m in self.models if m.name == name), "1")


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


def _virtual_key_rules(policy: Policy) -> Violations:
    """Each key names a tenant; ids and digests are unique."""
    tenants = {t.name for t in policy.tenants}
    found: Violations = []
    ids: dict[str, int] = {}
    digests: dict[str, int] = {}
    for index, key in enumerate(policy.keys):
        if ids.setdefault(key.id, index) != index:
            found.append((("keys", index, "id"), f"duplicate key id {key.id!r}"))
        if key.tenant not in tenants:
            found.append((("keys", index, "tenant"), f"key {key.id!r} names unknown tenant "
                          f"{key.tenant!r} (tenants: {_listing(sorted(tenants))})"))
        if digests.setdefault(key.hmac_sha256, index) != index:
            found.append((("keys", index, "hmac_sha256"),
                          "this key digest is listed more than once"))
    return found


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
