"""The sans-IO budget ledger: windows, reserve-then-settle, refusals (``now`` injected)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from hedgerow.errors import BudgetExceeded
from policies.budget import BudgetLedger, Spend, budget_lines, window
from policies.schema import Budget, Policy, PriorityClass, Tenant, VirtualKey

DAY = 86400.0


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def policy(*budgets: Budget, key_budgets: tuple[Budget, ...] = ()) -> Policy:
    return Policy(
        classes=(PriorityClass(name="interactive", ttft_slo_ms=1000, deadline_ms=10000),),
        tenants=(Tenant(name="acme", budgets=budgets),),
        keys=(VirtualKey(id="key_0123456789abcdef", tenant="acme", name="ci",
                         hmac_sha256="a" * 64, created_at=0.0, budgets=key_budgets),))


def test_windows_are_utc_days_and_months() -> None:
    assert window("day", at("2026-12-01T23:59:59")) == ("2026-12-01", at("2026-12-02T00:00:00"))
    assert window("month", at("2026-12-31T12:00:00")) == ("2026-12", at("2027-01-01T00:00:00"))
    assert window("month", at("2026-02-01T00:00:00")) == ("2026-02", at("2026-03-01T00:00:00"))


def test_a_reservation_counts_until_settled_with_the_actual_usage() -> None:
    now = at("2026-12-01T10:00:00")
    lines = budget_lines(policy(Budget(period="day", tokens=100)), "acme", None, now)
    ledger = BudgetLedger()
    assert ledger.reserve(lines, Spend(60, 0), now) is None
    # 60 reserved: a second request asking for 60 would pass the budget.
    refused = ledger.reserve(lines, Spend(60, 0), now)
    assert isinstance(refused, BudgetExceeded)
    ledger.settle(lines, Spend(60, 0), Spend(20, 0), now)  # it used only 20
    assert ledger.used(lines[0], now) == 20
    assert ledger.reserve(lines, Spend(60, 0), now) is None
    assert ledger.used(lines[0], now) == 80


def test_the_refusal_names_the_budget_and_its_reset() -> None:
    now = at("2026-12-01T10:00:00")
    limited = policy(key_budgets=(Budget(period="day", tokens=50),))
    lines = budget_lines(limited, "acme", limited.keys[0], now)
    ledger = BudgetLedger()
    assert ledger.reserve(lines, Spend(40, 0), now) is None
    refused = ledger.reserve(lines, Spend(20, 0), now)
    assert refused is not None
    assert refused.status == 429 and refused.code == "budget_exceeded"
    assert "key key_0123456789abcdef (ci)" in refused.message
    assert "50 tokens per day" in refused.message
    assert "resets at 2026-12-02 00:00 UTC" in refused.message
    assert refused.retry_after == pytest.approx(14 * 3600)
    assert refused.envelope()["error"]["code"] == "budget_exceeded"


def test_a_refusal_reserves_nothing_on_any_budget() -> None:
    now = at("2026-12-01T10:00:00")
    both = policy(Budget(period="day", tokens=1000),
                  key_budgets=(Budget(period="month", tokens=10),))
    lines = budget_lines(both, "acme", both.keys[0], now)
    assert [line.scope for line in lines] == ["tenant:acme", "key:key_0123456789abcdef"]
    ledger = BudgetLedger()
    assert ledger.reserve(lines, Spend(50, 0), now) is not None
    assert ledger.used(lines[0], now) == 0 and ledger.used(lines[1], now) == 0


def test_cost_budgets_count_cost_and_a_new_window_starts_from_zero() -> None:
    now = at("2026-12-01T23:00:00")
    budget = Budget(period="day", cost=1.0)
    lines = budget_lines(policy(budget), "acme", None, now)
    ledger = BudgetLedger()
    assert ledger.reserve(lines, Spend(10_000, 0.75), now) is None
    assert ledger.reserve(lines, Spend(1, 0.5), now) is not None
    tomorrow = now + 2 * 3600
    later = budget_lines(policy(budget), "acme", None, tomorrow)
    assert later[0].window == "2026-12-02"
    assert ledger.reserve(later, Spend(1, 0.5), tomorrow) is None
    # A request from yesterday settling today changes nothing in today's window.
    ledger.settle(lines, Spend(10_000, 0.75), Spend(10_000, 0.9), tomorrow)
    assert ledger.used(later[0], tomorrow) == 0.5


def test_a_budget_sets_exactly_one_measure() -> None:
    with pytest.raises(ValueError):
        Budget(period="day")
    with pytest.raises(ValueError):
        Budget(period="day", tokens=1, cost=1.0)
