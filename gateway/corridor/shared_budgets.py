"""Budgets shared by every gateway on one Redis (``--redis URL``).

The counters of ``policies.budget`` as Redis strings,
``hedgerow:budget:<scope>:<period>:<unit>:<window>``, each expiring a day
after its window ends. One Lua script checks every budget a request counts
against and reserves on all of them or none (atomic: two gateways never both
take the last of a budget); settling adds the difference between the usage
and the reservation. A budget spent through one gateway is refused by all.

Redis unreachable or slow: the request is decided by this gateway's own
ledger (``LocalBudgets``), logged once per outage, and Redis is not tried
again for ``RETRY_AFTER_S``; meanwhile each gateway enforces every budget on
its own, as without Redis. Settlements of reservations made in Redis that
fail are lost (the reservation stays counted: the error is on the safe side).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.corridor.key_gate import LocalBudgets
from hedgerow.errors import BudgetExceeded
from policies.budget import BudgetLine, Spend, first_refusal

log = logging.getLogger("hedgerow.gateway.budgets")

REDIS_TIMEOUT_S = 0.25
RETRY_AFTER_S = 1.0
KEEP_AFTER_WINDOW_S = 86_400

# KEYS: counters. ARGV: limit, amount, expire-at for each in turn.
# Returns {1} when reserved, else {0, index (1-based), used}.
_RESERVE = """
for i, key in ipairs(KEYS) do
  local used = tonumber(redis.call('GET', key) or '0')
  local limit, amount = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1])
  if used + amount > limit + 1e-9 then return {0, i, tostring(used)} end
end
for i, key in ipairs(KEYS) do
  redis.call('INCRBYFLOAT', key, ARGV[3 * i - 1])
  redis.call('EXPIREAT', key, ARGV[3 * i])
end
return {1}
"""

# KEYS: counters. ARGV: change, expire-at for each. Never below zero.
_SETTLE = """
for i, key in ipairs(KEYS) do
  local level = tonumber(redis.call('INCRBYFLOAT', key, ARGV[2 * i - 1]))
  if level < 0 then redis.call('SET', key, '0') end
  redis.call('EXPIREAT', key, ARGV[2 * i])
end
return 1
"""


class SharedBudgets:
    def __init__(self, redis: Redis, *, prefix: str = "hedgerow",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = redis
        self.prefix = prefix
        self.clock = clock
        self.local = LocalBudgets()
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._down_until = -math.inf
        self._outage = False

    async def reserve(self, lines: tuple[BudgetLine, ...], asked: Spend,
                      now: float) -> BudgetExceeded | None:
        if self.clock() < self._down_until:
            return await self.local.reserve(lines, asked, now)
        args: list[str] = []
        for line in lines:
            args += [repr(line.limit), repr(asked.of(line.unit)), _expire_at(line)]
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                answer = await self._reserve(keys=self._keys(lines), args=args)
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error)
            return await self.local.reserve(lines, asked, now)
        self._back()
        if int(answer[0]):
            return None
        index, used = int(answer[1]) - 1, float(_text(answer[2]))
        return first_refusal(lines[index:index + 1], [used], asked, now)

    async def settle(self, lines: tuple[BudgetLine, ...], reserved: Spend, actual: Spend,
                     now: float) -> None:
        live = tuple(line for line in lines if now < line.resets_at)
        if not live or self.clock() < self._down_until:
            await self.local.settle(live, reserved, actual, now)
            return
        args: list[str] = []
        for line in live:
            args += [repr(actual.of(line.unit) - reserved.of(line.unit)), _expire_at(line)]
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                await self._settle(keys=self._keys(live), args=args)
        except (RedisError, OSError, TimeoutError) as error:
            self._fell_back(error)

    def _keys(self, lines: tuple[BudgetLine, ...]) -> list[str]:
        return [f"{self.prefix}:budget:{line.counter}" for line in lines]

    def _back(self) -> None:
        if self._outage:
            self._outage = False
            log.warning("budgets: Redis is back; budgets hold across gateways again")

    def _fell_back(self, error: BaseException) -> None:
        self._down_until = self.clock() + RETRY_AFTER_S
        if not self._outage:
            self._outage = True
            log.warning("budgets: Redis unreachable (%s: %s); each gateway enforces budgets "
                        "on its own until it is back", type(error).__name__, error)


def _expire_at(line: BudgetLine) -> str:
    return str(int(line.resets_at) + KEEP_AFTER_WINDOW_S)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
