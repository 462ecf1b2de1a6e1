"""Tenants' request and token rates shared by every gateway on one Redis (``--redis URL``).

Each gateway admits with its own token buckets (``policies.admission``); with
several gateways behind a load balancer a tenant limited to N requests/s
would get N per gateway. With a Redis URL each request first takes one
request and its token estimate from the tenant's two buckets in Redis
(``requests_per_s``/``requests_burst`` and ``tokens_per_min``/``tokens_burst``),
in one Lua script: atomic, so two gateways never both take the last token,
and both or neither, so a refused request takes nothing. The arithmetic is
``policies.token_bucket.TokenBucket``'s — starts full, refills continuously
up to the burst — on Redis's clock, so the gateways' clocks never matter.
The local buckets still apply after it.

Tokens are charged as the local admission charges them: the estimate
(prompt tokens + ``max_tokens``), capped at the tenant's token burst, when
the request is admitted; when it ends (``ticket_done``) the bucket is settled
with what the worker really generated (unused tokens given back, extra usage
drained, never past full or empty). A request that the gateway's own
admission refuses after the shared check gets its whole token charge back.

Redis unreachable or slow (``REDIS_TIMEOUT_S``): the request is decided by the
local buckets alone, counted (``hedgerow_shared_limits_fallback_total``) and
logged once per outage; Redis is not tried again for ``RETRY_AFTER_S``, so an
outage costs no request more than one timeout. While it lasts each gateway
applies its own limits, so a tenant can get its limit from each.

``max_concurrency`` stays per gateway: a shared count needs leases that a
live gateway renews for as long as each stream runs (minutes) and that
expire when it dies, or a crashed gateway would hold its tenants' slots
forever; see docs/operations.md.

``gateway.corridor.scheduling.SchedulerDoor`` puts the check in front of the
scheduler: a ``submit`` refused here gets the same ``Refused`` (429
``requests_rate`` or ``tokens_rate``) the scheduler's own admission would,
and ``ticket_done`` settles here too.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.corridor.tickets import Ticket
from hedgerow.redis_conn import RedisTls, open_redis
from policies.admission import Refused
from policies.schema import Policy, TenantLimits

log = logging.getLogger("hedgerow.gateway.shared_limits")

REDIS_TIMEOUT_S = 0.25
RETRY_AFTER_S = 1.0
DEFAULT_PREFIX = "hedgerow"

# One bucket's state is a hash {level, at}; ``at`` is Redis's TIME in seconds.
# Floats go back as strings: Redis would truncate a Lua number to an integer.
_BUCKETS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local function refill(key, rate, burst)
  local saved = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(saved[1]), tonumber(saved[2])
  if level == nil or at == nil then return burst, now end
  level = math.min(level, burst)
  if now > at then return math.min(burst, level + (now - at) * rate), now end
  return level, at
end
local function save(key, level, at, rate, burst)
  redis.call('HSET', key, 'level', tostring(level), 'at', tostring(at))
  redis.call('PEXPIRE', key, math.ceil(burst / rate * 1000) + 1000)
end
"""

# KEYS: requests bucket, tokens bucket. ARGV: requests/s, requests burst,
# tokens/s, tokens burst, tokens to take, requests to take (1, or 0 when the
# request was charged at the door). Returns {granted, refused by, wait_s}.
_TAKE = _BUCKETS + """
local rrate, rburst = tonumber(ARGV[1]), tonumber(ARGV[2])
local trate, tburst, amount = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local need = tonumber(ARGV[6] or '1')
local requests, rat = refill(KEYS[1], rrate, rburst)
local tokens, tat = refill(KEYS[2], trate, tburst)
if requests + 1e-9 < need then return {0, 'requests', tostring((need - requests) / rrate)} end
if tokens + 1e-9 < amount then return {0, 'tokens', tostring((amount - tokens) / trate)} end
save(KEYS[1], math.max(0, requests - need), rat, rrate, rburst)
save(KEYS[2], math.max(0, tokens - amount), tat, trate, tburst)
return {1, '', '0'}
"""

# KEYS: a tokens bucket. ARGV: tokens/s, burst, change (> 0: given back,
# < 0: drained). The level stays within [0, burst]. Returns the new level.
_ADJUST = _BUCKETS + """
local rate, burst, change = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local level, at = refill(KEYS[1], rate, burst)
level = math.max(0, math.min(burst, level + change))
save(KEYS[1], level, at, rate, burst)
return tostring(level)
"""


class SharedRequestLimits:
    """The Redis side: per tenant, one requests/s and one tokens/min bucket for all gateways."""

    def __init__(self, redis: Redis, *, prefix: str = DEFAULT_PREFIX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self._take = redis.register_script(_TAKE)
        self._adjust = redis.register_script(_ADJUST)
        self._down_until = -math.inf
        self._outage = False
        # What each admitted ticket took from its shared tokens bucket (gone with the ticket).
        self._charged: weakref.WeakKeyDictionary[Ticket, float] = weakref.WeakKeyDictionary()
        # What each request charged at the door without a ticket (an embedding)
        # took, by request id, until it settles; bounded (the oldest forgotten).
        self._charged_requests: dict[str, float] = {}
        self.counters: dict[str, int] = {"checked": 0, "refused_requests": 0,
                                         "refused_tokens": 0, "fallback": 0}

    async def check(self, ticket: Ticket) -> Refused | None:
        """None: go on to local admission. A ``Refused``: a shared bucket is short."""
        limits = _limits_of(ticket)
        if limits is None:
            return None
        if self.clock() < self._down_until:
            self.counters["fallback"] += 1
            return None
        charge = float(min(ticket.estimated_tokens, limits.tokens_burst))
        args = [repr(limits.requests_per_s), str(limits.requests_burst),
                repr(limits.tokens_per_min / 60.0), str(limits.tokens_burst), repr(charge),
                "0" if ticket.request_charged else "1"]
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                granted, refused_by, wait = await self._take(
                    keys=self._keys(ticket.tenant), args=args)
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error)
            return None
        self._back()
        self.counters["checked"] += 1
        if int(granted):
            self._charged[ticket] = charge
            return None
        return self._refusal(ticket.tenant, limits, _text(refused_by), float(wait))

    async def charge_request(self, tenant: str, policy: Policy | None, tokens: float = 0.0,
                             request_id: str | None = None) -> Refused | None:
        """One request for ``tenant`` that needs no worker slot: its shared
        requests/s, and ``tokens`` of its shared tokens/min (an embedding's input;
        ``settle_request(request_id, ...)`` corrects them). None: charged, or
        nothing to charge, or Redis is down."""
        limits = _tenant_limits(policy, tenant)
        if limits is None or self.clock() < self._down_until:
            return None
        charge = float(min(tokens, limits.tokens_burst))
        args = [repr(limits.requests_per_s), str(limits.requests_burst),
                repr(limits.tokens_per_min / 60.0), str(limits.tokens_burst), repr(charge), "1"]
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                granted, refused_by, wait = await self._take(keys=self._keys(tenant), args=args)
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error)
            return None
        self._back()
        self.counters["checked"] += 1
        if not int(granted):
            return self._refusal(tenant, limits, _text(refused_by), float(wait))
        if charge > 0 and request_id is not None:
            if len(self._charged_requests) >= MAX_UNSETTLED_REQUESTS:
                del self._charged_requests[next(iter(self._charged_requests))]
            self._charged_requests[request_id] = charge
        return None

    async def settle_request(self, request_id: str, tenant: str, policy: Policy | None,
                             actual_tokens: float) -> None:
        """Correct the shared tokens bucket by what a request charged by
        ``charge_request`` really used (nothing, if it took nothing there)."""
        charged = self._charged_requests.pop(request_id, None)
        limits = _tenant_limits(policy, tenant)
        if charged is None or limits is None:
            return
        await self._adjust_tokens(tenant, limits, charged - actual_tokens)

    async def settle(self, ticket: Ticket, actual_tokens: int) -> None:
        """Correct the tenant's shared tokens bucket by what ``ticket`` really used
        (0: the request never ran, all of its charge goes back)."""
        charged = self._charged.pop(ticket, None)
        limits = _limits_of(ticket)
        if limits is None or charged is None:
            return
        await self._adjust_tokens(ticket.tenant, limits, charged - actual_tokens)

    async def _adjust_tokens(self, tenant: str, limits: TenantLimits, change: float) -> None:
        """Give ``change`` tokens back to ``tenant``'s shared bucket (negative: take)."""
        if change == 0 or self.clock() < self._down_until:
            return
        args = [repr(limits.tokens_per_min / 60.0), str(limits.tokens_burst), repr(change)]
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                await self._adjust(keys=self._keys(tenant)[1:], args=args)
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error, count=False)

    async def take_key(self, key_id: str, requests_per_s: float | None,
                       tokens_per_min: float | None, tokens: float) -> tuple[str, float] | None:
        """A virtual key's own requests/s and tokens/min (``gateway.corridor.key_gate``), in the
        same script as a tenant's. None: granted, or Redis is down (the gateway's own
        key buckets still apply); else what refused (``requests``/``tokens``) and the wait."""
        if self.clock() < self._down_until:
            return None
        args = [*_rate_args(requests_per_s, per_s=1.0), *_rate_args(tokens_per_min, per_s=60.0),
                repr(float(tokens)), "1"]
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                granted, refused_by, wait = await self._take(keys=self._key_keys(key_id),
                                                             args=args)
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error)
            return None
        self._back()
        return None if int(granted) else (_text(refused_by), float(wait))

    async def settle_key(self, key_id: str, tokens_per_min: float, change: float) -> None:
        """Give back (> 0) or drain (< 0) a key's shared tokens bucket."""
        if change == 0 or self.clock() < self._down_until:
            return
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                await self._adjust(keys=self._key_keys(key_id)[1:],
                                   args=[*_rate_args(tokens_per_min, per_s=60.0), repr(change)])
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error, count=False)

    def _key_keys(self, key_id: str) -> list[str]:
        base = f"{self.prefix}:keylimit:{key_id}"
        return [f"{base}:requests", f"{base}:tokens"]

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self.prefix}:ratelimit:{tenant}"
        return [f"{base}:requests", f"{base}:tokens"]

    def _refusal(self, tenant: str, limits: TenantLimits, refused_by: str,
                 wait: float) -> Refused:
        if refused_by == "tokens":
            self.counters["refused_tokens"] += 1
            return Refused(429, "tokens_rate", wait,
                           f"tenant {tenant!r} exceeded {limits.tokens_per_min:g} tokens per "
                           "minute (shared by all gateways)")
        self.counters["refused_requests"] += 1
        return Refused(429, "requests_rate", wait,
                       f"tenant {tenant!r} exceeded {limits.requests_per_s:g} requests "
                       "per second (shared by all gateways)")

    def _back(self) -> None:
        if self._outage:
            self._outage = False
            log.warning("shared rate limits: Redis is back; limits hold across gateways again")

    def _fell_back(self, error: BaseException, *, count: bool = True) -> None:
        if count:
            self.counters["fallback"] += 1
        self._down_until = self.clock() + RETRY_AFTER_S
        if not self._outage:
            self._outage = True
            log.warning("shared rate limits: Redis unreachable (%s: %s); each gateway applies "
                        "its own limits until it is back", type(error).__name__, error)


# A rate the key does not set: a bucket so large it never refuses.
_UNLIMITED = 1e12


def _rate_args(per_period: float | None, *, per_s: float) -> list[str]:
    """(rate per second, burst) of a bucket of ``per_period`` per ``per_s`` seconds:
    a second of requests (at least one), a minute of tokens."""
    if per_period is None:
        return [repr(_UNLIMITED), repr(_UNLIMITED)]
    return [repr(per_period / per_s), repr(max(1.0, per_period))]


# Requests charged tokens at the door and not settled yet, at most (each
# settles when it ends; the bound only guards against a caller that forgets).
MAX_UNSETTLED_REQUESTS = 65_536


def _limits_of(ticket: Ticket) -> TenantLimits | None:
    return _tenant_limits(ticket.policy, ticket.tenant)


def _tenant_limits(policy: Policy | None, tenant: str) -> TenantLimits | None:
    if policy is None:
        return None
    return next((t.limits for t in policy.tenants if t.name == tenant), None)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def add_shared_counters(stats: dict[str, Any], counters: dict[str, int]) -> dict[str, Any]:
    """Scheduler stats plus the shared limits' refusals and fallbacks (for /metrics)."""
    merged = dict(stats["counters"])
    merged["shed_shared_requests_rate"] = counters["refused_requests"]
    merged["shed_shared_tokens_rate"] = counters["refused_tokens"]
    merged["shared_limits_fallback"] = counters["fallback"]
    return {**stats, "counters": merged}


def open_shared_limits(url: str, tls: RedisTls = RedisTls()) -> SharedRequestLimits:
    redis = open_redis(url, tls, socket_timeout=REDIS_TIMEOUT_S, connect_timeout=REDIS_TIMEOUT_S)
    return SharedRequestLimits(redis)
