"""Usage per tenant, and OpenTelemetry GenAI metric names beside Hedgerow's own.

Counted once per completion request, when it ends (``RequestMetrics.finished``):

- ``hedgerow_tenant_requests_total{tenant,model,status}``: requests by the HTTP
  status they were answered with.
- ``hedgerow_tenant_tokens_total{tenant,model,type}``: ``prompt`` and
  ``completion`` are what a worker computed for the tenant, as the worker
  reported it in its usage (a client that left early is still charged what
  was generated); ``cached`` is prompt plus completion tokens of answers no
  worker computed for this request (response cache hits and single-flight
  joins).
- ``hedgerow_tenant_cost_total{tenant,model}``: those tokens priced with the
  model's ``price_per_million_tokens`` in the policy in force when the request
  arrived (no price: no cost is counted), in the policy's currency.

Labels stay bounded: a tenant is one the policy named (the request's identity),
``_unknown`` when the request was refused before its tenant was known (a bad
key), and ``_other`` past ``MAX_TENANTS`` distinct names; a model is a
canonical, known model or empty when refused before it was known.

The OpenTelemetry GenAI semantic conventions (v1.3x, development status), as
the OpenTelemetry-to-Prometheus rules spell them (dots to underscores, the
unit ``s`` as a ``_seconds`` suffix, ``{token}`` dropped), with the
conventions' bucket boundaries:

- ``gen_ai_client_token_usage{gen_ai_operation_name,gen_ai_request_model,
  gen_ai_token_type}``: per request that reported usage (cache hits included:
  what the client was told), ``input`` and ``output`` tokens.
- ``gen_ai_server_time_to_first_token_seconds{gen_ai_operation_name,
  gen_ai_request_model}``: streaming requests, like ``hedgerow_ttft_seconds``.
- ``gen_ai_server_request_duration_seconds{gen_ai_operation_name,
  gen_ai_request_model,error_type}``: every request that knew its model;
  ``error_type`` is the error code, empty on success.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from hedgerow.metrics import Histogram, HistogramSeries
from policies.schema import Policy

UNKNOWN_TENANT = "_unknown"
OTHER_TENANT = "_other"
MAX_TENANTS = 1024
# Resolved label children kept per counter; beyond it, resolved on each call.
MAX_RESOLVED = 4096

TOKEN_USAGE_BUCKETS: tuple[float, ...] = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
DURATION_BUCKETS: tuple[float, ...] = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


@dataclass(frozen=True)
class Usage:
    """One request's tokens: computed by a worker for it, or served without one."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False  # a cache hit or a single-flight join


@dataclass(frozen=True)
class Price:
    """Currency per million tokens (``policies.schema.ModelPrice``, as plain numbers)."""

    input: float
    output: float
    cached: float = 0.0

    def cost(self, usage: Usage) -> float:
        if usage.cached:
            tokens = usage.prompt_tokens + usage.completion_tokens
            return tokens * self.cached / 1e6
        return (usage.prompt_tokens * self.input + usage.completion_tokens * self.output) / 1e6


def policy_prices(policy: Policy) -> Callable[[str], Price | None]:
    """A model's price under ``policy`` (canonical name; None: not priced)."""
    def price(model: str) -> Price | None:
        found = policy.model_price(model)
        return None if found is None else Price(found.input, found.output, found.cached)

    return price


@dataclass(frozen=True)
class Finished:
    """What one completion request came to, as usage metrics need it."""

    tenant: str
    model: str
    operation: str  # "chat" or "text_completion"
    status: int
    error_code: str
    usage: Usage | None
    price: Price | None
    duration_s: float
    ttft_s: float | None


class UsageMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("hedgerow_tenant_requests", "Completion requests by tenant, "
                                "model and HTTP status.", ("tenant", "model", "status"),
                                registry=r)
        self.tokens = Counter("hedgerow_tenant_tokens", "Tokens by tenant and model: prompt "
                              "and completion as workers reported them; cached: answers "
                              "served without a worker (cache hits, single-flight joins).",
                              ("tenant", "model", "type"), registry=r)
        self.cost = Counter("hedgerow_tenant_cost", "Tokens priced with the policy's "
                            "price_per_million_tokens, in its currency.", ("tenant", "model"),
                            registry=r)
        operation_model = ("gen_ai_operation_name", "gen_ai_request_model")
        self.token_usage = Histogram(
            "gen_ai_client_token_usage", "GenAI semantic conventions: input and output tokens "
            "per request.", (*operation_model, "gen_ai_token_type"), TOKEN_USAGE_BUCKETS, r)
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds", "GenAI semantic conventions: time to "
            "the first token of streaming requests.", operation_model, TTFT_BUCKETS, r)
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds", "GenAI semantic conventions: request "
            "duration; error_type empty on success.", (*operation_model, "error_type"),
            DURATION_BUCKETS, r)
        self._tenants: set[str] = set()
        self._children: dict[tuple[Any, ...], Any] = {}

    def tenant_label(self, tenant: str) -> str:
        """A bounded label for ``tenant`` (see the module docstring)."""
        if not tenant:
            return UNKNOWN_TENANT
        if tenant not in self._tenants:
            if len(self._tenants) >= MAX_TENANTS:
                return OTHER_TENANT
            self._tenants.add(tenant)
        return tenant

    def finished(self, done: Finished) -> None:
        tenant = self.tenant_label(done.tenant)
        self._child(self.requests, tenant, done.model, str(done.status)).inc()
        if done.model:
            error = "" if done.status < 400 and not done.error_code else (
                done.error_code or str(done.status))
            self._series(self.duration, done.operation, done.model, error).observe(
                done.duration_s)
            if done.ttft_s is not None:
                self._series(self.ttft, done.operation, done.model).observe(done.ttft_s)
        usage = done.usage
        if usage is None:
            return
        self._count_tokens(tenant, done.model, usage)
        if done.price is not None:
            self._child(self.cost, tenant, done.model).inc(done.price.cost(usage))
        for kind, count in (("input", usage.prompt_tokens), ("output", usage.completion_tokens)):
            self._series(self.token_usage, done.operation, done.model, kind).observe(count)

    def _count_tokens(self, tenant: str, model: str, usage: Usage) -> None:
        if usage.cached:
            self._child(self.tokens, tenant, model, "cached").inc(
                usage.prompt_tokens + usage.completion_tokens)
            return
        self._child(self.tokens, tenant, model, "prompt").inc(usage.prompt_tokens)
        self._child(self.tokens, tenant, model, "completion").inc(usage.completion_tokens)

    def _child(self, counter: Counter, *labels: str) -> Any:
        key = (id(counter), *labels)
        child = self._children.get(key)
        if child is None:
            child = counter.labels(*labels)
            if len(self._children) < MAX_RESOLVED:
                self._children[key] = child
        return child

    def _series(self, histogram: Histogram, *labels: str) -> HistogramSeries:
        return histogram.labels(*labels)
