"""Admission control: take a request in now, or refuse it cheaply and say when to retry (sans-IO).

A refusal at the door costs microseconds and never touches a worker; a request
that is admitted but cannot meet its deadline costs a queue slot, a worker
slot and the user's time, and then fails anyway. So ``Admission.admit``
refuses early, in this order:

    429 (the tenant's own limits, ``RateLimited``)
        "concurrency"    the tenant already has ``max_concurrency`` requests open
        "requests_rate"  the tenant's requests/s bucket is empty
        "tokens_rate"    the tenant's tokens/min bucket cannot cover the estimate
    503 (capacity, ``NoHealthyWorker``)
        "queue_full"     the model's queue is at the global bound
        "deadline"       predicted queue wait + predicted prefill > time left

It returns ``Admitted`` or ``Refused`` and never raises for a refusal. A
refused request consumes nothing: every check is made before anything is
taken. Tokens are charged at admission from an estimate (prompt tokens +
``max_tokens``) and ``settle`` corrects the bucket with the actual usage.
``release`` ends a request's hold on its tenant's concurrency.

A request whose estimate exceeds the tenant's whole token burst would never
fit; it is charged the full burst instead (so it waits for a full bucket and
is then admitted), and ``settle`` charges what it really used.

Limits come as any object with the five ``LimitsLike`` attributes: the
policy's ``policies.schema.TenantLimits`` fits as is, and ``AdmissionLimits``
(where ``None`` means unlimited) serves defaults and tests.

``WaitPredictor`` supplies ``predicted_wait_s``: requests that must finish
before this one can start, spread over the slots, times an EWMA of service
time. It is monotone non-decreasing in the queue length ahead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from hedgerow.errors import HedgerowError, NoHealthyWorker, RateLimited, RuntimeFault
from policies.token_bucket import TokenBucket

RefusalReason = Literal[
    "requests_rate", "tokens_rate", "concurrency", "queue_full", "deadline", "no_healthy_worker"
]


class LimitsLike(Protocol):
    """One tenant's limits as admission reads them; ``None`` means unlimited.
    A missing burst defaults to one second of requests (at least 1) and one
    minute of tokens."""

    @property
    def requests_per_s(self) -> float | None: ...
    @property
    def requests_burst(self) -> float | None: ...
    @property
    def tokens_per_min(self) -> float | None: ...
    @property
    def tokens_burst(self) -> float | None: ...
    @property
    def max_concurrency(self) -> int | None: ...


@dataclass(frozen=True)
class AdmissionLimits:
    """A ``LimitsLike`` with every limit off by default."""

    requests_per_s: float | None = None
    requests_burst: float | None = None
    tokens_per_min: float | None = None
    tokens_burst: float | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "requests_burst", "tokens_per_min", "tokens_burst"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, not {value!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, not {self.max_concurrency!r}")


@dataclass(frozen=True)
class Admitted:
    tenant: str
    tokens_charged: float  # the estimate, or the tenant's token burst if smaller


@dataclass(frozen=True)
class Refused:
    status: Literal[429, 503]
    reason: RefusalReason
    retry_after_s: float  # finite, >= 0; the Retry-After header rounds it up to >= 1 s
    message: str

    def to_error(self) -> HedgerowError:
        """The client-facing error: 429 ``RateLimited`` or 503 ``NoHealthyWorker``,
        with ``code`` set to the reason and ``Retry-After`` from ``retry_after_s``."""
        kind = RateLimited if self.status == 429 else NoHealthyWorker
        return kind(self.message, code=self.reason, retry_after=self.retry_after_s)


AdmissionDecision = Admitted | Refused


class _TenantState:
    def __init__(self, limits: LimitsLike) -> None:
        self.limits = limits
        self.active = 0
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        if limits.requests_per_s is not None:
            burst = limits.requests_burst or max(1.0, limits.requests_per_s)
            self.requests = TokenBucket(limits.requests_per_s, burst)
        if limits.tokens_per_min is not None:
            burst = limits.tokens_burst or limits.tokens_per_min
            self.tokens = TokenBucket(limits.tokens_per_min / 60.0, burst)

    def token_charge(self, estimated_tokens: float) -> float:
        return estimated_tokens if self.tokens is None else min(estimated_tokens, self.tokens.burst)


class Admission:
    """Per-tenant rate, token and concurrency limits plus global capacity checks."""

    def __init__(
        self,
        limits: Mapping[str, LimitsLike],
        *,
        max_queue: int,
        default_limits: LimitsLike = AdmissionLimits(),
        concurrency_retry_after_s: float = 1.0,
        max_retry_after_s: float = 60.0,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, not {max_queue!r}")
        self.max_queue = max_queue
        self.concurrency_retry_after_s = concurrency_retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._limits = dict(limits)
        self._default_limits = default_limits
        self._tenants: dict[str, _TenantState] = {}

    def reconfigure(
        self,
        limits: Mapping[str, LimitsLike],
        *,
        max_queue: int,
        default_limits: LimitsLike = AdmissionLimits(),
    ) -> None:
        """Apply new limits (a policy reload). Tenants whose limits changed get fresh,
        full buckets; open requests keep counting against concurrency."""
        self.max_queue = max_queue
        self._limits = dict(limits)
        self._default_limits = default_limits
        for name, state in list(self._tenants.items()):
            new_limits = self._limits_of(name)
            if new_limits != state.limits:
                fresh = _TenantState(new_limits)
                fresh.active = state.active
                self._tenants[name] = fresh

    def admit(
        self,
        tenant: str,
        estimated_tokens: float,
        predicted_wait_s: float,
        predicted_prefill_s: float,
        deadline_s: float,
        now: float,
        *,
        queue_length: int,
        charge_request: bool = True,
    ) -> AdmissionDecision:
        """Decide on one request.

        ``deadline_s`` is the time the request has left (seconds from ``now``);
        ``queue_length`` is how many requests wait now in what ``max_queue``
        bounds (all models together, if the bound is global).
        ``charge_request=False``: the request's requests/s was charged already
        (``charge_request``), so that bucket is neither checked nor taken.
        """
        if not (estimated_tokens >= 0 and math.isfinite(estimated_tokens)):
            raise ValueError(f"estimated_tokens must be finite and >= 0, not {estimated_tokens!r}")
        state = self._state(tenant)
        charge = state.token_charge(estimated_tokens)
        refusal = self._tenant_refusal(tenant, state, charge, now,
                                       check_requests=charge_request) or self._capacity_refusal(
            predicted_wait_s, predicted_prefill_s, deadline_s, queue_length
        )
        if refusal is not None:
            return refusal
        if state.requests is not None and charge_request:
            state.requests.try_take(1.0, now)
        if state.tokens is not None:
            state.tokens.try_take(charge, now)
        state.active += 1
        return Admitted(tenant, charge)

    def charge_request(self, tenant: str, now: float, tokens: float = 0.0) -> Refused | None:
        """A request answered without a worker slot (a cache hit, a single-flight
        join, an embedding): it counts against the tenant's requests/s like any
        other, so cached answers cannot lift a tenant past its rate, and
        ``tokens`` (an embedding's input; ``settle`` corrects it) against its
        tokens/min. It waits in no queue and holds no concurrency. None:
        charged; a ``Refused`` (429 ``requests_rate`` or ``tokens_rate``): a
        bucket is short, nothing taken."""
        if not (tokens >= 0 and math.isfinite(tokens)):
            raise ValueError(f"tokens must be finite and >= 0, not {tokens!r}")
        state = self._state(tenant)
        charge = state.token_charge(tokens)
        refusal = self._tenant_refusal(tenant, state, charge, now, check_concurrency=False)
        if refusal is not None:
            return refusal
        if state.requests is not None:
            state.requests.try_take(1.0, now)
        if state.tokens is not None and charge > 0:
            state.tokens.try_take(charge, now)
        return None

    def settle(self, tenant: str, estimated: float, actual: float, now: float) -> float:
        """Correct the tenant's token bucket once actual usage is known.

        ``estimated`` is what was passed to ``admit``. Returns ``actual - estimated``
        (positive: the estimate was short). Unused tokens go back to the bucket
        (never above burst); extra usage is drained from it (never below zero).
        """
        state = self._state(tenant)
        difference = actual - estimated
        if state.tokens is not None:
            extra = actual - state.token_charge(estimated)
            if extra > 0:
                state.tokens.drain(extra, now)
            elif extra < 0:
                state.tokens.give_back(-extra, now)
        return difference

    def release(self, tenant: str) -> None:
        """A request admitted for ``tenant`` has ended (any outcome)."""
        state = self._tenants.get(tenant)
        if state is None or state.active == 0:
            raise RuntimeFault(f"release for tenant {tenant!r} with no admitted request open",
                               code="admission_release_unbalanced")
        state.active -= 1

    def active(self, tenant: str) -> int:
        """Requests admitted for ``tenant`` and not yet released."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.active

    def _limits_of(self, tenant: str) -> LimitsLike:
        return self._limits.get(tenant, self._default_limits)

    def _state(self, tenant: str) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState(self._limits_of(tenant))
        return state

    def _tenant_refusal(
        self, tenant: str, state: _TenantState, charge: float, now: float,
        *, check_requests: bool = True, check_concurrency: bool = True,
    ) -> Refused | None:
        limit = state.limits.max_concurrency
        if check_concurrency and limit is not None and state.active >= limit:
            return self._refuse(429, "concurrency", self.concurrency_retry_after_s,
                                f"tenant {tenant!r} already has {limit} requests open")
        if state.requests is not None and check_requests:
            wait = state.requests.time_until(1.0, now)
            if wait > 0:
                return self._refuse(429, "requests_rate", wait,
                                    f"tenant {tenant!r} exceeded {state.requests.rate_per_s:g} "
                                    "requests per second")
        if state.tokens is not None:
            wait = state.tokens.time_until(charge, now)
            if wait > 0:
                return self._refuse(429, "tokens_rate", wait,
                                    f"tenant {tenant!r} exceeded "
                                    f"{state.tokens.rate_per_s * 60:g} tokens per minute")
        return None

    def _capacity_refusal(
        self, wait_s: float, prefill_s: float, deadline_s: float, queue_length: int
    ) -> Refused | None:
        if queue_length >= self.max_queue:
            return self._refuse(503, "queue_full", wait_s,
                                f"the queue is full ({self.max_queue} requests waiting)")
        late_by = wait_s + prefill_s - deadline_s
        if late_by > 0 or math.isnan(late_by):
            return self._refuse(503, "deadline", late_by,
                                f"predicted wait {wait_s:.3f} s + prefill {prefill_s:.3f} s "
                                f"exceeds the {deadline_s:.3f} s left before the deadline")
        return None

    def _refuse(
        self, status: Literal[429, 503], reason: RefusalReason, retry_after_s: float, message: str
    ) -> Refused:
        bounded = self.max_retry_after_s if math.isnan(retry_after_s) else retry_after_s
        bounded = min(max(bounded, 0.0), self.max_retry_after_s)
        return Refused(status, reason, bounded, message)


class WaitPredictor:
    """Predicts how long a request will wait in the queue before a slot takes it.

    ``predict_wait(queue_ahead, active, slots)``: of the requests ahead and the
    ones running, all but ``slots - 1`` must finish before this one starts;
    finishing proceeds ``slots`` at a time, each taking the mean service time
    (an EWMA of ``observe_service``; ``initial_service_s`` until the first
    observation). No slots at all means an infinite wait.
    """

    def __init__(self, *, initial_service_s: float = 1.0, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], not {alpha!r}")
        if not (initial_service_s >= 0 and math.isfinite(initial_service_s)):
            raise ValueError(f"initial_service_s must be finite, >= 0: {initial_service_s!r}")
        self.alpha = alpha
        self._mean_service_s = initial_service_s
        self._observed = False

    @property
    def mean_service_s(self) -> float:
        return self._mean_service_s

    def observe_service(self, seconds: float) -> None:
        """A request held a worker slot for ``seconds`` (dispatch to end)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"a service time must be finite and >= 0, not {seconds!r}")
        if not self._observed:
            self._mean_service_s, self._observed = seconds, True
        else:
            self._mean_service_s += self.alpha * (seconds - self._mean_service_s)

    def predict_wait(self, queue_ahead: int, active: int, slots: int) -> float:
        """Seconds a request joining now behind ``queue_ahead`` others will wait."""
        must_finish = queue_ahead + active - slots + 1
        if must_finish <= 0:
            return 0.0
        if slots <= 0:
            return math.inf
        return must_finish / slots * self._mean_service_s
