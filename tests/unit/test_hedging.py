from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.hedging import HedgeBudget, QuantileSketch, hedge_delay


def filled(values: list[float], window: int = 512, min_samples: int = 1) -> QuantileSketch:
    sketch = QuantileSketch(window=window, min_samples=min_samples)
    for value in values:
        sketch.observe(value)
    return sketch


def test_quantile_is_none_until_min_samples() -> None:
    sketch = QuantileSketch(window=100, min_samples=3)
    sketch.observe(1.0)
    sketch.observe(2.0)
    assert sketch.quantile(0.5) is None
    sketch.observe(3.0)
    assert sketch.quantile(0.5) == 2.0


def test_nearest_rank_quantiles() -> None:
    sketch = filled([float(v) for v in range(1, 101)])
    assert sketch.quantile(0.95) == 95.0
    assert sketch.quantile(0.5) == 50.0
    assert sketch.quantile(0.0) == 1.0
    assert sketch.quantile(1.0) == 100.0


def test_window_forgets_old_samples() -> None:
    sketch = filled([10.0] * 50 + [0.1] * 20, window=20)
    assert len(sketch) == 20
    assert sketch.quantile(0.99) == 0.1  # the pool got faster; the sketch followed


def test_rejects_bad_samples_and_quantiles() -> None:
    sketch = QuantileSketch()
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            sketch.observe(bad)
    with pytest.raises(ValueError):
        sketch.quantile(1.5)
    with pytest.raises(ValueError):
        QuantileSketch(window=10, min_samples=11)


@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=300), st.floats(0, 1),
       st.integers(1, 300))
def test_quantile_matches_the_definition(values: list[float], q: float, window: int) -> None:
    sketch = filled(values, window=window)
    held = sorted(values[-window:])
    answer = sketch.quantile(q)
    assert answer in held
    at_or_below = sum(v <= answer for v in held) / len(held)
    assert at_or_below >= q - 1e-12
    below = sum(v < answer for v in held) / len(held)
    assert below < q or answer == held[0]


def test_hedge_delay_follows_the_quantile_within_floor_and_ceiling() -> None:
    sketch = filled([0.2] * 95 + [3.0] * 5, min_samples=20)
    assert hedge_delay(sketch, 0.95, floor_s=0.05, ceiling_s=2.0) == 0.2
    assert hedge_delay(sketch, 0.99, floor_s=0.05, ceiling_s=2.0) == 2.0
    assert hedge_delay(sketch, 0.5, floor_s=0.5, ceiling_s=2.0) == 0.5


def test_cold_sketch_hedges_only_at_the_ceiling() -> None:
    sketch = QuantileSketch(min_samples=20)
    sketch.observe(0.1)
    assert hedge_delay(sketch, 0.95, floor_s=0.05, ceiling_s=2.0) == 2.0


def test_hedge_delay_rejects_inverted_bounds() -> None:
    with pytest.raises(ValueError):
        hedge_delay(QuantileSketch(), 0.95, floor_s=2.0, ceiling_s=1.0)


def test_budget_starts_empty_and_earns_one_hedge_per_twenty_requests() -> None:
    budget = HedgeBudget(ratio=0.05, burst=10)
    assert not budget.try_spend()
    for _ in range(19):
        budget.on_request()
    assert not budget.try_spend()
    budget.on_request()
    assert budget.try_spend()
    assert not budget.try_spend()
    assert (budget.requests_seen, budget.hedges_spent) == (20, 1)


def test_budget_saves_up_to_burst_only() -> None:
    budget = HedgeBudget(ratio=0.5, burst=3)
    for _ in range(100):
        budget.on_request()
    assert budget.level == 3
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("ratio, burst", [(0.0, 10.0), (0.5, 0.0), (0.5, 0.99)])
def test_no_ratio_or_a_burst_below_one_never_hedges(ratio: float, burst: float) -> None:
    budget = HedgeBudget(ratio=ratio, burst=burst)
    for _ in range(1000):
        budget.on_request()
    assert not budget.try_spend()


@given(st.floats(0, 1), st.floats(0, 50),
       st.lists(st.sampled_from(["request", "spend"]), max_size=400))
def test_hedges_never_exceed_ratio_of_requests_plus_burst(
    ratio: float, burst: float, events: list[str],
) -> None:
    budget = HedgeBudget(ratio=ratio, burst=burst)
    requests = spent = 0
    for event in events:
        if event == "request":
            budget.on_request()
            requests += 1
        else:
            spent += budget.try_spend()
        assert spent <= ratio * requests + burst
        assert spent <= ratio * requests + 1e-6  # starts empty: no free initial burst
        assert 0 <= budget.level <= burst
