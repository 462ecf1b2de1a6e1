from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.token_bucket import TokenBucket


def test_starts_full_and_refuses_once_empty() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=3.0)
    assert [bucket.try_take(1, now=0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.level(0.0) == 0.0


def test_refills_at_rate_up_to_burst() -> None:
    bucket = TokenBucket(rate_per_s=2.0, burst=5.0)
    assert bucket.try_take(5, now=10.0)
    assert bucket.level(11.0) == pytest.approx(2.0)
    assert bucket.level(100.0) == 5.0


def test_refused_take_takes_nothing() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=10.0)
    assert bucket.try_take(7, now=0.0)
    assert not bucket.try_take(4, now=0.0)
    assert bucket.level(0.0) == pytest.approx(3.0)


def test_time_until_is_exactly_enough() -> None:
    bucket = TokenBucket(rate_per_s=3.0, burst=10.0)
    bucket.try_take(10, now=0.0)
    wait = bucket.time_until(4, now=0.0)
    assert wait == pytest.approx(4 / 3)
    assert not bucket.try_take(4, now=wait * 0.99)
    assert bucket.try_take(4, now=wait)


def test_time_until_is_zero_when_available_and_inf_above_burst() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=2.0)
    assert bucket.time_until(2, now=0.0) == 0.0
    assert bucket.time_until(2.5, now=0.0) == math.inf
    assert not bucket.try_take(2.5, now=1e9)


def test_give_back_never_exceeds_burst() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=4.0)
    bucket.try_take(3, now=0.0)
    bucket.give_back(2, now=0.0)
    assert bucket.level(0.0) == pytest.approx(3.0)
    bucket.give_back(100, now=0.0)
    assert bucket.level(0.0) == 4.0


def test_drain_takes_what_is_there_and_no_more() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=4.0)
    assert bucket.drain(3, now=0.0) == 3
    assert bucket.drain(3, now=0.0) == pytest.approx(1.0)
    assert bucket.level(0.0) == 0.0


def test_clock_going_backwards_earns_nothing() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=10.0)
    bucket.try_take(10, now=100.0)
    assert bucket.level(50.0) == 0.0
    assert bucket.level(101.0) == pytest.approx(1.0)


@pytest.mark.parametrize("rate, burst", [(0, 1), (-1, 1), (1, 0), (math.inf, 1), (1, math.nan)])
def test_rejects_nonsense_configuration(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)


@pytest.mark.parametrize("amount", [-1.0, math.nan, math.inf])
def test_rejects_nonsense_amounts(amount: float) -> None:
    bucket = TokenBucket(1.0, 1.0)
    for call in (bucket.try_take, bucket.give_back, bucket.drain, bucket.time_until):
        with pytest.raises(ValueError):
            call(amount, 0.0)


operations = st.lists(
    st.tuples(
        st.sampled_from(["take", "give_back", "drain", "time_until", "level"]),
        st.floats(0, 50, allow_nan=False),
        st.floats(-5, 30, allow_nan=False),  # time step; negative = clock went back
    ),
    max_size=60,
)


@given(st.floats(0.01, 100), st.floats(0.5, 40), operations)
def test_level_stays_within_zero_and_burst(rate: float, burst: float,
                                           ops: list[tuple[str, float, float]]) -> None:
    bucket = TokenBucket(rate, burst)
    now = 0.0
    for name, amount, step in ops:
        now += step
        before = bucket.level(now)
        if name == "take":
            granted = bucket.try_take(amount, now)
            assert granted == (amount <= before + 1e-9)
        elif name == "give_back":
            bucket.give_back(amount, now)
        elif name == "drain":
            bucket.drain(amount, now)
        elif name == "time_until":
            assert bucket.time_until(amount, now) >= 0
        assert 0.0 <= bucket.level(now) <= burst


@given(st.floats(0.01, 100), st.floats(1, 40), st.lists(st.floats(0, 5), max_size=40))
def test_takes_never_exceed_burst_plus_earnings(rate: float, burst: float,
                                                steps: list[float]) -> None:
    bucket = TokenBucket(rate, burst)
    now, taken = 0.0, 0
    for step in steps:
        now += step
        while bucket.try_take(1, now):
            taken += 1
    assert taken <= burst + rate * now + 1e-6
