"""The per-connection HTTP/2 budgets, decided without I/O (``gateway.edge.h2_budget``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from importlib.metadata import version

import h2.events
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.exceptions import ProtocolError
from hyperframe.frame import DataFrame, WindowUpdateFrame

from gateway.edge.h2_budget import H2Budget, H2Limits, RateBucket, parse_h2_limits
from gateway.edge.h2_guard import _charge, _count_frames, _Guard
from gateway.admin.metrics import h2_families


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


def test_window_updates_are_bounded_per_data_frame_sent_as_in_envoy() -> None:
    budget = H2Budget(H2Limits(max_window_updates_per_data_frame=3), now=0.0)
    # Before anything was sent: the connection's own allowance (3).
    assert [budget.window_updates_received(1) for _ in range(4)] == [None] * 3 + [
        "window_updates"]
    budget = H2Budget(H2Limits(max_window_updates_per_data_frame=3), now=0.0)
    budget.stream_opened(1, 0.0)  # a new stream's window may be widened: 3 more
    for _ in range(2):
        budget.data_frame_sent()  # each DATA frame sent may be credited: 3 more each
    assert budget.window_updates_received(12) is None
    assert budget.window_updates_received(1) == "window_updates"


def test_a_reader_crediting_every_frame_twice_is_never_cut() -> None:
    # A slow reader with tiny windows: one DATA frame at a time, each credited
    # on its stream and on the connection -- for as long as it likes.
    budget = H2Budget(H2Limits(), now=0.0)
    budget.stream_opened(1, 0.0)
    for _ in range(10_000):
        budget.data_frame_sent()
        assert budget.window_updates_received(2) is None


@given(st.lists(st.tuples(st.sampled_from(["data", "stream", "updates"]),
                          st.integers(min_value=1, max_value=30)), max_size=200))
def test_window_updates_never_pass_ten_per_thing_earned(steps: list[tuple[str, int]]) -> None:
    budget = H2Budget(H2Limits(), now=0.0)
    stream = 1
    for step, count in steps:
        if step == "data":
            for _ in range(count):
                budget.data_frame_sent()
        elif step == "stream":
            budget.begin_read()
            budget.stream_opened(stream, 0.0)
            stream += 2
        else:
            earned = 1 + budget.opened + budget.data_frames_sent
            cut = budget.window_updates_received(count) is not None
            assert cut == (budget.window_updates > 10 * earned)
            if cut:
                return
    assert budget.window_updates <= 10 * (1 + budget.opened + budget.data_frames_sent)


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
    # gateway/edge/h2_guard.py wraps private methods of hypercorn's H2Protocol:
    # an upgrade must be re-read against it (and the attack tests rerun).
    from gateway.edge.h2_guard import H2_VERSION, HYPERCORN_VERSION

    assert version("hypercorn") == HYPERCORN_VERSION
    assert version("h2") == H2_VERSION


def test_cuts_are_counted_each_but_logged_at_most_every_ten_seconds(
        caplog: pytest.LogCaptureFixture) -> None:
    from gateway.edge.h2_guard import LOG_EVERY_S, H2GuardStats

    stats = H2GuardStats()
    for n in range(50):
        stats.count_cut("pings", "192.0.2.1", now=n * 0.1)  # 5 s of cuts
    stats.count_cut("settings", "192.0.2.2", now=LOG_EVERY_S + 1)
    assert stats.snapshot()["cut"]["pings"] == 50
    lines = [r.getMessage() for r in caplog.records if "cut: over" in r.getMessage()]
    assert len(lines) == 2
    assert "49 more cut" in lines[1]


def _served_stream(guard_limits: H2Limits) -> tuple[H2Connection, H2Connection, _Guard]:
    """A server h2 connection (counted as the guard counts it) that has
    answered its client's stream 1 completely; the client; the guard."""
    server = H2Connection(H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    guard = _Guard(guard_limits, now=0.0)
    _count_frames(server, guard)
    client = H2Connection(H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", "x"),
                            (":path", "/")], end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200")])
    server.send_data(1, b"hi", end_stream=True)
    client.receive_data(server.data_to_send())
    return server, client, guard


def test_window_updates_h2_drops_silently_are_still_counted() -> None:
    # A WINDOW_UPDATE for a closed stream raises no h2 event: a guard that
    # counted events would never see a flood of them.
    server, _, guard = _served_stream(H2Limits(max_window_updates_per_data_frame=2))
    assert guard.budget.data_frames_sent == 1
    update = WindowUpdateFrame(1, window_increment=1).serialize()
    events = server.receive_data(update * 5)
    assert events == []  # h2 drops them: the stream is closed
    assert guard.window_updates == 5
    # 2 x (the connection + the one DATA frame sent) = 4 allowed; the read had 5.
    assert _charge(guard, events, now=1.0) == "window_updates"
    assert guard.window_updates == 0


def test_streams_widened_as_they_open_are_not_cut() -> None:
    # HEADERS and a WINDOW_UPDATE for each new stream in one write (clients
    # that widen every stream's window at once): the read's streams are
    # charged before its updates, so each brings its own allowance.
    server, client, guard = _served_stream(H2Limits(max_window_updates_per_data_frame=1))
    for stream in range(3, 3 + 2 * 50, 2):
        client.send_headers(stream, [(":method", "GET"), (":scheme", "https"),
                                     (":authority", "x"), (":path", "/")], end_stream=True)
        client.increment_flow_control_window(1 << 20, stream_id=stream)
    events = server.receive_data(client.data_to_send())
    assert guard.window_updates == 50
    assert _charge(guard, events, now=1.0) is None


@pytest.mark.parametrize("stream_id", [0, 1])
def test_a_zero_increment_is_a_connection_error_in_h2(stream_id: int) -> None:
    # What the budget relies on: h2 (hyperframe) refuses a zero increment on
    # the connection and on a stream alike, before any budget sees it.
    server, _, guard = _served_stream(H2Limits())
    frame = WindowUpdateFrame(stream_id)
    frame.window_increment = 0
    with pytest.raises(ProtocolError):
        server.receive_data(frame.serialize())
    assert guard.window_updates == 0


def test_error_resets_are_cut_past_the_connections_budget() -> None:
    budget = H2Budget(H2Limits(max_error_resets=5), now=0.0)
    assert [budget.error_resets_sent(2) for _ in range(2)] == [None, None]
    assert budget.error_resets_sent(1) is None  # 5: the budget itself
    assert budget.error_resets_sent(1) == "error_resets"


@given(st.lists(st.integers(min_value=1, max_value=50), max_size=50))
def test_error_resets_never_pass_the_budget_unanswered(reads: list[int]) -> None:
    budget = H2Budget(H2Limits(max_error_resets=100), now=0.0)
    for count in reads:
        if budget.error_resets_sent(count) is not None:
            assert budget.error_resets > 100
            return
    assert budget.error_resets <= 100


def _get(client: H2Connection, stream: int, end_stream: bool = True) -> None:
    client.send_headers(stream, [(":method", "GET"), (":scheme", "https"), (":authority", "x"),
                                 (":path", "/")], end_stream=end_stream)


def test_resets_h2_answers_protocol_errors_with_are_counted() -> None:
    # DATA after a request's END_STREAM: h2 resets the stream (STREAM_CLOSED)
    # itself, and a second DATA on it gets another RST_STREAM with no event
    # at all. Each is counted as h2 parses the read; the read is charged.
    server, client, guard = _served_stream(H2Limits(max_error_resets=2))
    frames = b"".join(DataFrame(1, b"x").serialize() for _ in range(3))
    events = server.receive_data(frames)
    assert guard.error_resets == 3
    assert _charge(guard, events, now=1.0) == "error_resets"
    assert guard.error_resets == 0


def test_a_client_that_obeys_the_protocol_causes_no_error_resets() -> None:
    # Streams answered, cancelled by the client, widened, pinged: none of it
    # is a protocol error, and our own resets are not the client's.
    server, client, guard = _served_stream(H2Limits(max_error_resets=1))
    for stream in range(3, 23, 2):
        _get(client, stream, end_stream=False)
        client.increment_flow_control_window(1 << 16, stream_id=stream)
        client.reset_stream(stream)
    _get(client, 23, end_stream=False)
    client.ping(b"12345678")
    server.receive_data(client.data_to_send())
    server.reset_stream(23)  # the server cancels a stream: not the client's fault
    assert guard.error_resets == 0


def test_a_stream_reset_in_the_read_that_opened_it_starts_no_work() -> None:
    # HEADERS then RST_STREAM (the client's: Rapid Reset) or DATA after
    # END_STREAM (h2 resets it: a reset flood), in one read: the stream is
    # closed before the app would see it. A stream opened alone is served.
    from gateway.edge.h2_guard import _reset_streams, _stillborn

    server, client, _ = _served_stream(H2Limits())
    _get(client, 3, end_stream=False)
    client.reset_stream(3)
    _get(client, 5)
    _get(client, 7)
    events = server.receive_data(client.data_to_send()
                                 + DataFrame(5, b"x").serialize())
    reset = _reset_streams(events)
    opened = [e for e in events if isinstance(e, h2.events.RequestReceived)]
    assert [e.stream_id for e in opened if _stillborn(e, reset)] == [3, 5]
    assert [e.stream_id for e in opened if not _stillborn(e, reset)] == [7]
