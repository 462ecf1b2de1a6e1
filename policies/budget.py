"""Budgets per tenant and per key: tokens or cost per UTC day or month (sans-IO).

The same reserve-then-settle pattern as the token buckets: at admission a
request reserves what it may use at most (its prompt estimate plus
``max_tokens``, priced with the model's ``price_per_million_tokens``) on every
budget it counts against; when it ends, ``settle`` replaces the reservation
with what it really used. A request is refused, with nothing reserved, when
any one budget's spend so far (settled and reserved) plus its reservation
would pass the limit, so concurrent requests cannot overshoot a budget
together; a client near the end of a budget can still get a short answer by
asking for fewer ``max_tokens``.

Windows are calendar periods in UTC: a day from 00:00, a month from the 1st.
Each window has its own counter, named by ``BudgetLine.counter``, so a new
window starts from zero and an old one is simply forgotten (``BudgetLedger``
drops it; Redis lets it expire). Time is a parameter: ``now`` in seconds
since the epoch.

``BudgetLedger`` is one gateway's own book (no Redis: each gateway enforces
every budget by itself, so N gateways allow up to N times a budget);
``gateway.corridor.shared_budgets`` keeps the same counters in Redis for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from hedgerow.errors import BudgetExceeded
from policies.schema import Budget, Policy, VirtualKey

Unit = Literal["tokens", "cost"]
MAX_COUNTERS = 100_000


@dataclass(frozen=True)
class Spend:
    tokens: float
    cost: float

    def of(self, unit: Unit) -> float:
        return self.tokens if unit == "tokens" else self.cost


@dataclass(frozen=True)
class BudgetLine:
    """One budget a request counts against, in the window that holds ``now``."""

    owner: str  # "tenant acme", "key key_0a1b… (ci)"
    scope: str  # storage name: "tenant:acme", "key:key_0a1b…"
    period: Literal["day", "month"]
    unit: Unit
    limit: float
    window: str  # "2026-12-01", "2026-12"
    resets_at: float  # epoch seconds

    @property
    def counter(self) -> str:
        return f"{self.scope}:{self.period}:{self.unit}:{self.window}"

    def refusal(self, used: float, asked: float, now: float) -> BudgetExceeded:
        reset = datetime.fromtimestamp(self.resets_at, UTC).strftime("%Y-%m-%d %H:%M UTC")
        what = (f"{_amount(self.limit, self.unit)} per {self.period}")
        return BudgetExceeded(
            f"budget exceeded: {self.owner} may use {what}; {_amount(used, self.unit)} used "
            f"or reserved, this request may use up to {_amount(asked, self.unit)}; "
            f"the budget resets at {reset}", code="budget_exceeded",
            retry_after=max(1.0, self.resets_at - now))


def _amount(value: float, unit: Unit) -> str:
    return f"{math.ceil(value):d} tokens" if unit == "tokens" else f"{value:.6g} (cost)"


def window(period: Literal["day", "month"], now: float) -> tuple[str, float]:
    """The window holding ``now``: its name and when the next one starts."""
    at = datetime.fromtimestamp(now, UTC)
    if period == "day":
        start = at.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.strftime("%Y-%m-%d"), start.timestamp() + 86400.0
    year, month = (at.year + 1, 1) if at.month == 12 else (at.year, at.month + 1)
    return at.strftime("%Y-%m"), datetime(year, month, 1, tzinfo=UTC).timestamp()


def budget_lines(policy: Policy, tenant: str, key: VirtualKey | None,
                 now: float) -> tuple[BudgetLine, ...]:
    """Every budget a request of ``tenant`` (with ``key``, if any) counts against."""
    owned: list[tuple[str, str, Budget]] = []
    for found in policy.tenants:
        if found.name == tenant:
            owned += [(f"tenant {tenant!r}", f"tenant:{tenant}", b) for b in found.budgets]
    if key is not None:
        label = f"key {key.id}" + (f" ({key.name})" if key.name else "")
        owned += [(label, f"key:{key.id}", b) for b in key.budgets]
    lines = []
    for owner, scope, budget in owned:
        name, resets_at = window(budget.period, now)
        unit: Unit = "tokens" if budget.tokens is not None else "cost"
        limit = float(budget.tokens if budget.tokens is not None else budget.cost or 0.0)
        lines.append(BudgetLine(owner, scope, budget.period, unit, limit, name, resets_at))
    return tuple(lines)


def first_refusal(lines: Sequence[BudgetLine], used: Sequence[float], asked: Spend,
                  now: float) -> BudgetExceeded | None:
    """The refusal for the first budget that ``asked`` would pass, given what each has used."""
    for line, spent in zip(lines, used, strict=True):
        want = asked.of(line.unit)
        if spent + want > line.limit + 1e-9:
            return line.refusal(spent, want, now)
    return None


class BudgetLedger:
    """One gateway's budget counters."""

    def __init__(self, max_counters: int = MAX_COUNTERS) -> None:
        self.max_counters = max_counters
        self._used: dict[str, tuple[float, float]] = {}  # counter → (used, resets_at)

    def used(self, line: BudgetLine, now: float) -> float:
        spent, resets_at = self._used.get(line.counter, (0.0, line.resets_at))
        return spent if now < resets_at else 0.0

    def reserve(self, lines: Sequence[BudgetLine], asked: Spend,
                now: float) -> BudgetExceeded | None:
        """Reserve ``asked`` on every line, or on none and say which one refused."""
        self._forget_ended(now)
        refusal = first_refusal(lines, [self.used(line, now) for line in lines], asked, now)
        if refusal is None:
            for line in lines:
                self._add(line, asked.of(line.unit), now)
        return refusal

    def settle(self, lines: Sequence[BudgetLine], reserved: Spend, actual: Spend,
               now: float) -> None:
        """Replace a reservation with the actual spend (never below zero)."""
        for line in lines:
            self._add(line, actual.of(line.unit) - reserved.of(line.unit), now)

    def _add(self, line: BudgetLine, change: float, now: float) -> None:
        if now >= line.resets_at:  # settled after its window ended: the new one starts clean
            return
        if line.counter not in self._used and len(self._used) >= self.max_counters:
            raise OverflowError("too many budget counters; see policies.budget.MAX_COUNTERS")
        spent = self.used(line, now)
        self._used[line.counter] = (max(0.0, spent + change), line.resets_at)

    def _forget_ended(self, now: float) -> None:
        if len(self._used) < self.max_counters // 2:
            return
        for counter in [c for c, (_, end) in self._used.items() if now >= end]:
            del self._used[counter]
