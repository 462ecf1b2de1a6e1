"""Tenants' requests/s limits shared by every gateway on one Redis (``--redis URL``).

Each gateway admits with its own token buckets (``policies.admission``); with
several gateways behind a load balancer a tenant limited to N requests/s
would get N per gateway. With a Redis URL each request first takes a token
from one bucket per tenant kept in Redis, by a Lua script (atomic, so two
gateways never both take the last token). The script is the same arithmetic
as ``policies.token_bucket.TokenBucket`` — starts full, refills continuously
at ``requests_per_s`` up to ``requests_burst`` — on Redis's clock, so the
gateways' clocks never matter. The local buckets still apply after it.

Redis unreachable or slow (``REDIS_TIMEOUT_S``): the request is decided by the
local buckets alone, counted (``hedgerow_shared_limits_fallback_total``) and
logged once per outage; Redis is not tried again for ``RETRY_AFTER_S``, so an
outage costs no request more than one timeout. While it lasts a tenant can
get its limit from each gateway.

Only the requests/s limit is shared: ``tokens_per_min`` and
``max_concurrency`` stay per gateway.

``SharedLimitsScheduler`` puts the check in front of the scheduler actor: it
answers ``Submit`` with the same ``Refused`` (429 ``requests_rate``) the
scheduler's own admission would, and passes every other message through.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.tickets import Stats, Submit, Ticket
from hedgerow.actors import ActorRef
from policies.admission import Refused

log = logging.getLogger("hedgerow.gateway.shared_limits")

REDIS_TIMEOUT_S = 0.25
RETRY_AFTER_S = 1.0
DEFAULT_PREFIX = "hedgerow"

# KEYS: the bucket. ARGV: rate per s, burst, amount. Returns {granted, wait_s}.
# Floats go back as strings: Redis would truncate a Lua number to an integer.
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local saved = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(saved[1])
local at = tonumber(saved[2])
if level == nil or at == nil then
  level = burst
  at = now
end
level = math.min(level, burst)
if now > at then
  level = math.min(burst, level + (now - at) * rate)
  at = now
end
local granted = 0
local wait = 0
if amount <= level + 1e-9 then
  level = math.max(0, level - amount)
  granted = 1
else
  wait = (amount - level) / rate
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(at))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {granted, tostring(wait)}
"""


class SharedRequestLimits:
    """The Redis side: one requests/s bucket per tenant, shared by all gateways."""

    def __init__(self, redis: Redis, *, prefix: str = DEFAULT_PREFIX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self._take = redis.register_script(_TAKE)
        self._down_until = -math.inf
        self._outage = False
        self.counters: dict[str, int] = {"checked": 0, "refused": 0, "fallback": 0}

    async def check(self, ticket: Ticket) -> Refused | None:
        """None: go on to local admission. A ``Refused``: the tenant's shared bucket is empty."""
        if ticket.policy is None:
            return None
        limits = next((t.limits for t in ticket.policy.tenants if t.name == ticket.tenant), None)
        if limits is None:
            return None
        if self.clock() < self._down_until:
            self.counters["fallback"] += 1
            return None
        key = f"{self.prefix}:ratelimit:{ticket.tenant}:requests"
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                granted, wait = await self._take(
                    keys=[key], args=[repr(limits.requests_per_s), str(limits.requests_burst), "1"])
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error)
            return None
        if self._outage:
            self._outage = False
            log.warning("shared rate limits: Redis is back; limits hold across gateways again")
        self.counters["checked"] += 1
        if int(granted):
            return None
        self.counters["refused"] += 1
        return Refused(429, "requests_rate", float(wait),
                       f"tenant {ticket.tenant!r} exceeded {limits.requests_per_s:g} requests "
                       "per second (shared by all gateways)")

    def _fell_back(self, error: BaseException) -> None:
        self.counters["fallback"] += 1
        self._down_until = self.clock() + RETRY_AFTER_S
        if not self._outage:
            self._outage = True
            log.warning("shared rate limits: Redis unreachable (%s: %s); each gateway applies "
                        "its own limits until it is back", type(error).__name__, error)


class SharedLimitsScheduler:
    """The scheduler's ref with the shared check in front of ``Submit``."""

    def __init__(self, scheduler: ActorRef, limits: SharedRequestLimits) -> None:
        self.scheduler = scheduler
        self.limits = limits
        self.name = scheduler.name

    async def ask(self, message: Any, *, timeout: float = 5.0) -> Any:
        if isinstance(message, Submit):
            refusal = await self.limits.check(message.ticket)
            if refusal is not None:
                return refusal
        answer = await self.scheduler.ask(message, timeout=timeout)
        if isinstance(message, Stats):
            answer = add_shared_counters(answer, self.limits.counters)
        return answer

    async def tell(self, message: Any) -> None:
        await self.scheduler.tell(message)

    def tell_nowait(self, message: Any) -> None:
        self.scheduler.tell_nowait(message)


def add_shared_counters(stats: dict[str, Any], counters: dict[str, int]) -> dict[str, Any]:
    """Scheduler stats plus the shared limits' refusals and fallbacks (for /metrics)."""
    merged = dict(stats["counters"])
    merged["shed_shared_requests_rate"] = counters["refused"]
    merged["shared_limits_fallback"] = counters["fallback"]
    return {**stats, "counters": merged}


def open_shared_limits(url: str) -> SharedRequestLimits:
    redis = Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                           socket_connect_timeout=REDIS_TIMEOUT_S)
    return SharedRequestLimits(redis)
