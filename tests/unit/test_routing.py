from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.routing import Candidate, pick_least_inflight


def cand(wid: str, slots: int = 1, active: int = 0, draining: bool = False) -> Candidate:
    return Candidate(worker_id=wid, slots=slots, reported_active=active, reported_queued=0,
                     draining=draining)


def test_picks_least_inflight() -> None:
    chosen = pick_least_inflight([cand("a"), cand("b")], {"a": 2, "b": 1})
    assert chosen is not None and chosen.worker_id == "b"


def test_inflight_is_relative_to_slots() -> None:
    chosen = pick_least_inflight([cand("small", 1), cand("big", 4)], {"small": 1, "big": 2})
    assert chosen is not None and chosen.worker_id == "big"


def test_skips_draining_and_excluded() -> None:
    workers = [cand("a", draining=True), cand("b"), cand("c")]
    chosen = pick_least_inflight(workers, {}, exclude={"b"})
    assert chosen is not None and chosen.worker_id == "c"
    assert pick_least_inflight([cand("a", draining=True)], {}) is None
    assert pick_least_inflight([], {}) is None


def test_ties_broken_by_reported_load_then_id() -> None:
    chosen = pick_least_inflight([cand("b", active=1), cand("a", active=1), cand("c")], {})
    assert chosen is not None and chosen.worker_id == "c"
    chosen = pick_least_inflight([cand("b"), cand("a")], {})
    assert chosen is not None and chosen.worker_id == "a"


@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 10), min_size=1))
def test_chosen_has_minimal_inflight(inflight: dict[str, int]) -> None:
    workers = [cand(w) for w in inflight]
    chosen = pick_least_inflight(workers, inflight)
    assert chosen is not None
    assert inflight[chosen.worker_id] == min(inflight.values())
