"""The per-connection HTTP/2 budgets, decided without I/O (``gateway.h2_budget``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from importlib.metadata import version

from gateway.h2_budget import H2Budget, H2Limits, RateBucket, parse_h2_limits
from gateway.metrics import h2_families


def _open_and_reset(budget: H2Budget, count: int, now: float, first_id: int = 1,
                    age_s: float = 0.0) -> list[str | None]:
    """Streams opened 100 a second (inside the rate budget), each reset ``age_s`` later."""
    verdicts: list[str | None] = []
    for n in range(count):
        stream, opened = first_id + 2 * n, now + n * 0.01
        budget.begin_read()
        verdicts.append(budget.stream_opened(stream, opened))
        verdicts.append(budget.stream_reset_by_client(stream, opened + age_s))
    return verdicts


def test_rapid_reset_is_cut_at_half_of_envoys_window() -> None:
    budget = H2Budget(H2Limits(), now=0.0)
    verdicts = _open_and_reset(budget, 250, now=0.0)
    assert verdicts[:-1] == [None] * 499  # 249 premature resets pass
    assert verdicts[-1] == "rapid_reset"  # the 250th: half of Envoy's 500


def test_resets_after_the_minimum_lifetime_are_not_premature() -> None:
    budget = H2Budget(H2Limits(), now=0.0)
    assert set(_open_and_reset(budget, 2000, now=0.0, age_s=1.5)) == {None}


def test_beyond_the_window_half_of_all_closed_streams_must_be_premature() -> None:
    budget = H2Budget(H2Limits(), now=0.0)
    for n in range(600):  # 600 answered streams
        budget.begin_read()
        assert budget.stream_opened(1 + 2 * n, n * 0.01) is None
        budget.stream_closed(1 + 2 * n)
    # 600 premature resets more would be needed for half; 599 pass.
    later = _open_and_reset(budget, 600, now=100.0, first_id=1201)
    assert later[:-1] == [None] * 1199 and later[-1] == "rapid_reset"


def test_a_reset_of_a_stream_already_answered_costs_nothing() -> None:
    budget = H2Budget(H2Limits(), now=0.0)
    assert budget.stream_opened(1, 0.0) is None
    budget.stream_closed(1)
    assert budget.stream_reset_by_client(1, 0.0) is None
    assert budget.premature == 0 and budget.closed == 1


def test_new_streams_in_one_read_are_bounded_as_in_nginx() -> None:
    budget = H2Budget(H2Limits(max_new_streams_per_read=3), now=0.0)
    budget.begin_read()
    assert [budget.stream_opened(s, 0.0) for s in (1, 3, 5, 7)] == [
        None, None, None, "streams_per_read"]
    budget.begin_read()  # the next read starts afresh
    assert budget.stream_opened(9, 0.0) is None


def test_new_streams_per_second_refill() -> None:
    budget = H2Budget(H2Limits(new_streams_per_s=10, new_streams_burst=5), now=0.0)
    verdicts = []
    for n in range(6):
        budget.begin_read()
        verdicts.append(budget.stream_opened(1 + 2 * n, 0.0))
    assert verdicts == [None] * 5 + ["streams_per_s"]
    budget.begin_read()
    assert budget.stream_opened(99, 0.1) is None  # 0.1 s at 10/s: one more


def test_pings_and_settings_have_buckets_and_a_per_read_bound() -> None:
    budget = H2Budget(H2Limits(pings_burst=2, settings_burst=1), now=0.0)
    assert [budget.ping(0.0) for _ in range(3)] == [None, None, "pings"]
    assert [budget.settings_frame(0.0) for _ in range(2)] == [None, "settings"]
    budget = H2Budget(H2Limits(max_control_frames_per_read=2), now=0.0)
    assert [budget.ping(0.0), budget.settings_frame(0.0), budget.ping(0.0)] == [
        None, None, "control_frames"]


def test_consecutive_empty_frames_as_in_envoy() -> None:
    budget = H2Budget(H2Limits(), now=0.0)
    assert budget.frame_payload(empty=True) is None
    assert budget.frame_payload(empty=False) is None  # a payload resets the run
    assert budget.frame_payload(empty=True) is None
    assert budget.frame_payload(empty=True) == "empty_frames"


def test_priority_frames_are_bounded_per_stream_opened_as_in_envoy() -> None:
    budget = H2Budget(H2Limits(max_priority_frames_per_stream=2), now=0.0)
    assert [budget.priority_frame() for _ in range(3)] == [None, None, "priority"]
    budget = H2Budget(H2Limits(max_priority_frames_per_stream=2), now=0.0)
    budget.stream_opened(1, 0.0)  # one stream opened: two more allowed
    assert [budget.priority_frame() for _ in range(5)] == [None] * 4 + ["priority"]


@given(st.lists(st.floats(min_value=0, max_value=10), max_size=200))
def test_a_bucket_never_grants_more_than_burst_plus_refill(gaps: list[float]) -> None:
    bucket = RateBucket(rate=5.0, burst=10, now=0.0)
    now, granted = 0.0, 0
    for gap in gaps:
        now += gap
        granted += bucket.take(now)
    assert granted <= 10 + 5.0 * now + 1e-9


def test_open_stream_records_are_released() -> None:
    budget = H2Budget(H2Limits(), now=0.0)
    for n in range(1000):
        budget.begin_read()
        budget.stream_opened(1 + 2 * n, n * 0.01)
        budget.stream_closed(1 + 2 * n)
    assert budget.opened_at == {}


def test_limits_from_the_command_line() -> None:
    limits = parse_h2_limits(["pings_per_s=2.5", "max_new_streams_per_read=7"])
    assert limits.pings_per_s == 2.5 and limits.max_new_streams_per_read == 7
    for bad in ["nope=1", "pings_burst=²", "pings_burst=0", "pings_per_s=inf",
                "pings_per_s=-1", "pings_burst=1.5", "pings_burst"]:
        with pytest.raises(ValueError):
            parse_h2_limits([bad])


def test_metric_families() -> None:
    stats = {"cut": {"rapid_reset": 2, "pings": 1}, "drained": 3}
    text = {sample.name: sample for family in h2_families(stats) for sample in family.samples}
    assert text["hedgerow_h2_connections_drained_total"].value == 3
    assert h2_families({}) == []


def test_the_guard_patches_the_versions_it_was_written_for() -> None:
    # gateway/h2_guard.py wraps private methods of hypercorn's H2Protocol:
    # an upgrade must be re-read against it (and the attack tests rerun).
    from gateway.h2_guard import H2_VERSION, HYPERCORN_VERSION

    assert version("hypercorn") == HYPERCORN_VERSION
    assert version("h2") == H2_VERSION


def test_cuts_are_counted_each_but_logged_at_most_every_ten_seconds(
        caplog: pytest.LogCaptureFixture) -> None:
    from gateway.h2_guard import LOG_EVERY_S, H2GuardStats

    stats = H2GuardStats()
    for n in range(50):
        stats.count_cut("pings", "192.0.2.1", now=n * 0.1)  # 5 s of cuts
    stats.count_cut("settings", "192.0.2.2", now=LOG_EVERY_S + 1)
    assert stats.snapshot()["cut"]["pings"] == 50
    lines = [r.getMessage() for r in caplog.records if "cut: over" in r.getMessage()]
    assert len(lines) == 2
    assert "49 more cut" in lines[1]
