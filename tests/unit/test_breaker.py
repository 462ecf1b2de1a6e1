from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgerow.errors import RuntimeFault
from policies.breaker import (
    TRANSITIONS,
    BreakerConfig,
    BreakerInput,
    BreakerState,
    BreakerTransition,
    CircuitBreaker,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
SUCCESS, FAILURE, PERMIT, TIMER, ABANDON = (
    BreakerInput.SUCCESS, BreakerInput.FAILURE, BreakerInput.PERMIT, BreakerInput.TIMER,
    BreakerInput.ABANDON,
)
CONFIG = BreakerConfig(failure_threshold=3, open_for_s=5.0, max_open_for_s=20.0,
                       probe_timeout_s=2.0)


def breaker_in(situation: str) -> tuple[CircuitBreaker, float]:
    """A breaker in a named situation, and the time it is in it."""
    breaker = CircuitBreaker(CONFIG)
    if situation == "closed":
        return breaker, 0.0
    for _ in range(3):
        breaker.on_failure(0.0)
    if situation == "open":
        return breaker, 1.0
    assert breaker.state(5.0) is HALF_OPEN
    if situation == "half_open_probe_out":
        assert breaker.allow(5.0)
    return breaker, 5.0


# (situation, input) -> (answer, state after); None: the pair is a bug and raises.
# Written out independently of the module's table; inputs come in at the
# situation's time, except TIMER which comes when the timer is due.
EXPECTED: dict[tuple[str, BreakerInput], tuple[bool, BreakerState] | None] = {
    ("closed", SUCCESS): (True, CLOSED),
    ("closed", FAILURE): (True, CLOSED),  # 1 of 3
    ("closed", PERMIT): (True, CLOSED),
    ("closed", TIMER): None,
    ("closed", ABANDON): (True, CLOSED),
    ("open", SUCCESS): (True, OPEN),
    ("open", FAILURE): (True, OPEN),
    ("open", PERMIT): (False, OPEN),
    ("open", TIMER): (True, HALF_OPEN),
    ("open", ABANDON): (True, OPEN),
    ("half_open", SUCCESS): (True, HALF_OPEN),  # no probe out: stale outcome
    ("half_open", FAILURE): (True, HALF_OPEN),
    ("half_open", PERMIT): (True, HALF_OPEN),
    ("half_open", TIMER): None,
    ("half_open", ABANDON): (True, HALF_OPEN),
    ("half_open_probe_out", SUCCESS): (True, CLOSED),
    ("half_open_probe_out", FAILURE): (True, OPEN),
    ("half_open_probe_out", PERMIT): (False, HALF_OPEN),
    ("half_open_probe_out", TIMER): (True, OPEN),
    ("half_open_probe_out", ABANDON): (True, HALF_OPEN),
}


@pytest.mark.parametrize("situation, event", list(EXPECTED))
def test_every_state_input_pair(situation: str, event: BreakerInput) -> None:
    breaker, now = breaker_in(situation)
    due = breaker.next_timer()
    if event is TIMER and due is not None:
        now = due
    expected = EXPECTED[(situation, event)]
    if expected is None:
        with pytest.raises(RuntimeFault):
            breaker.process(event, now)
        return
    answer = breaker.process(event, now)
    assert (answer, breaker._state) == expected


def test_table_covers_exactly_the_legal_pairs() -> None:
    illegal = {(CLOSED, TIMER)}
    everything = set(itertools.product(BreakerState, BreakerInput))
    assert set(TRANSITIONS) == everything - illegal


def test_early_timer_is_a_bug() -> None:
    breaker, _ = breaker_in("open")
    with pytest.raises(RuntimeFault):
        breaker.process(TIMER, 4.9)
    breaker, _ = breaker_in("half_open_probe_out")
    with pytest.raises(RuntimeFault):
        breaker.process(TIMER, 6.0)


def test_trips_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(CONFIG)
    for _ in range(5):
        breaker.on_failure(0.0)
        breaker.on_failure(0.0)
        breaker.on_success(0.0)
    assert breaker.state(0.0) is CLOSED
    breaker.on_failure(0.0)
    breaker.on_failure(0.0)
    breaker.on_failure(0.0)
    assert breaker.state(0.0) is OPEN
    assert not breaker.allow(4.99)


def test_recovery_through_one_probe() -> None:
    seen: list[BreakerTransition] = []
    breaker = CircuitBreaker(CONFIG, on_transition=seen.append)
    for _ in range(3):
        breaker.on_failure(10.0)
    assert breaker.next_timer() == 15.0
    assert breaker.allow(15.0)
    assert not breaker.allow(15.1)  # one probe at a time
    breaker.on_success(15.5)
    assert breaker.state(15.5) is CLOSED and breaker.allow(15.5)
    assert [(t.from_state, t.to_state, t.at, t.cause) for t in seen] == [
        (CLOSED, OPEN, 10.0, FAILURE),
        (OPEN, HALF_OPEN, 15.0, TIMER),  # the lazy timer fired inside allow()
        (HALF_OPEN, CLOSED, 15.5, SUCCESS),
    ]
    assert breaker.transitions_total == {OPEN: 1, HALF_OPEN: 1, CLOSED: 1}


def test_failed_probes_double_the_open_time_up_to_the_cap() -> None:
    breaker = CircuitBreaker(CONFIG)
    for _ in range(3):
        breaker.on_failure(0.0)
    now, open_times = 0.0, []
    for _ in range(4):
        due = breaker.next_timer()
        assert due is not None
        open_times.append(due - now)
        now = due
        assert breaker.allow(now)
        breaker.on_failure(now)
    assert open_times == [5.0, 10.0, 20.0, 20.0]
    now = breaker.next_timer() or 0.0
    assert breaker.allow(now)
    breaker.on_success(now)
    for _ in range(3):
        breaker.on_failure(now)
    assert breaker.next_timer() == now + 5.0  # a success resets the backoff


def test_unanswered_probe_times_out_as_a_failure() -> None:
    breaker, now = breaker_in("half_open_probe_out")
    assert breaker.next_timer() == now + 2.0
    assert breaker.state(now + 2.0) is OPEN
    assert breaker.next_timer() == now + 2.0 + 10.0


def test_abandoned_probe_frees_the_permit() -> None:
    breaker, now = breaker_in("half_open_probe_out")
    breaker.on_abandoned(now)
    assert breaker.allow(now)


def test_late_outcomes_while_open_change_nothing() -> None:
    breaker, now = breaker_in("open")
    breaker.on_success(now)
    breaker.on_failure(now)
    assert breaker.state(now) is OPEN and breaker.next_timer() == 5.0


@given(st.lists(st.tuples(st.sampled_from(["ok", "fail", "allow", "abandon", "look"]),
                          st.floats(0, 8, allow_nan=False)), max_size=80))
def test_follows_the_table_under_any_sequence(ops: list[tuple[str, float]]) -> None:
    seen: list[BreakerTransition] = []
    breaker = CircuitBreaker(CONFIG, on_transition=seen.append)
    legal = {(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED), (HALF_OPEN, OPEN)}
    now, probes_out = 0.0, 0
    for name, step in ops:
        now += step
        state = breaker.state(now)
        if state is not HALF_OPEN:
            probes_out = 0
        if name == "ok":
            breaker.on_success(now)
        elif name == "fail":
            breaker.on_failure(now)
        elif name == "abandon":
            breaker.on_abandoned(now)
            probes_out = 0
        elif name == "allow":
            granted = breaker.allow(now)
            assert granted == (state is CLOSED or (state is HALF_OPEN and probes_out == 0))
            probes_out += granted and state is HALF_OPEN
        if name in ("ok", "fail"):
            probes_out = 0
        due = breaker.next_timer()
        if breaker.state(now) is OPEN:
            assert due is not None and now < due <= now + CONFIG.max_open_for_s
    assert all((t.from_state, t.to_state) in legal for t in seen)
    assert all(a.to_state == b.from_state for a, b in itertools.pairwise(seen))
    assert sum(breaker.transitions_total.values()) == len(seen)


def test_rejects_nonsense_configuration() -> None:
    with pytest.raises(ValueError):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ValueError):
        BreakerConfig(open_for_s=10, max_open_for_s=5)
