"""StreamLog and StreamBook bounds, with time injected."""

from __future__ import annotations

import pytest

from gateway.corridor.stream_log import ReaderOverrun, StreamBook, StreamLog
from hedgerow.errors import NoHealthyWorker, StreamGone, StreamNotFound


def event(text: str) -> bytes:
    return b'data: {"t":"' + text.encode() + b'"}\n\n'


def test_ids_count_up_and_old_events_fall_out_past_the_byte_bound() -> None:
    log = StreamLog("r", "t", max_bytes=100)
    for i in range(10):
        log.append("token", event(f"piece-{i}"), received=0.0)
    assert log.last_id == 10 and log.bytes <= 100
    kept = log.events_after(8)
    assert [e.id for e in kept] == [9, 10]
    assert kept[-1].payload.startswith(b"id: 10\ndata: ")
    assert not log.holds_after(0)
    with pytest.raises(ReaderOverrun):
        log.events_after(0)


def test_finished_streams_are_resumable_for_their_retention_then_gone() -> None:
    book = StreamBook(max_streams=10, max_total_bytes=1 << 20, retain_s=5.0)
    log = StreamLog("r", "t", max_bytes=1 << 16)
    book.add(log, now=0.0)
    log.append("done", b"data: [DONE]\n\n", received=0.0)
    log.finish(now=1.0)
    assert book.find("r", "t", now=5.9) is log
    with pytest.raises(StreamGone):
        book.find("r", "t", now=6.1)
    with pytest.raises(StreamNotFound):
        book.find("r", "other-tenant", now=0.5)
    with pytest.raises(StreamNotFound):
        book.find("never", "t", now=0.5)


def test_a_refused_stream_expires_like_any_finished_one() -> None:
    book = StreamBook(max_streams=10, max_total_bytes=1 << 20, retain_s=1.0)
    log = StreamLog("r", "t", max_bytes=1 << 16)
    book.add(log, now=0.0)
    log.refuse(NoHealthyWorker("none"))
    log.finish(now=0.5)
    book.expire(now=2.0)
    assert len(book) == 0


def test_finished_streams_are_evicted_first_when_over_count_or_bytes() -> None:
    book = StreamBook(max_streams=2, max_total_bytes=1 << 20, retain_s=60.0)
    running = StreamLog("running", "t", max_bytes=1 << 16)
    book.add(running, now=0.0)
    done = StreamLog("done", "t", max_bytes=1 << 16)
    book.add(done, now=0.0)
    done.finish(now=0.1)
    book.add(StreamLog("new", "t", max_bytes=1 << 16), now=0.2)
    assert book.find("running", "t", now=0.3) is running
    with pytest.raises(StreamGone):
        book.find("done", "t", now=0.3)


@pytest.mark.anyio
async def test_the_generation_stops_a_grace_after_its_last_reader_leaves_not_before() -> None:
    import anyio

    log = StreamLog("r", "t", 1 << 20)
    generating = anyio.CancelScope()
    with log.reading():
        log.stop_when_abandoned(generating, grace_s=0.2)
        log.open("w", hedged=False)
        assert generating.deadline == float("inf")  # read: runs on
    left = anyio.current_time()
    assert left <= generating.deadline <= left + 0.2  # nobody reads: the grace runs
    with log.reading():  # a client came back (Last-Event-ID): the grace is off again
        assert generating.deadline == float("inf")
    with generating:
        await anyio.sleep(5)
    assert generating.cancelled_caught and anyio.current_time() - left < 1.0


@pytest.mark.anyio
async def test_a_generation_nobody_reads_before_its_first_token_stops_at_once() -> None:
    import anyio

    log, generating = StreamLog("r", "t", 1 << 20), anyio.CancelScope()
    with log.reading():
        log.stop_when_abandoned(generating, grace_s=30)
    assert generating.cancel_called  # its client never learnt its id
    other, scope = StreamLog("s", "t", 1 << 20), anyio.CancelScope()
    with other.reading():
        other.stop_when_abandoned(scope, grace_s=30)
        other.cancel("stopped by the client")
        assert scope.cancel_called
