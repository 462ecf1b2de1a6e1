"""The plain parts of the backend seam: requests, the decode-rate meter, the FIFO slot pool."""

from __future__ import annotations

import anyio
import pytest

from hedgerow.errors import InvalidRequest
from workers.backend import (
    DecodeRateMeter,
    Finished,
    GenerationEvent,
    GenerationRequest,
    GenerationStream,
    GenerationStreamBase,
    SeveralChoices,
    SlotPool,
    TokenChunk,
)


def test_request_needs_exactly_one_of_messages_or_prompt() -> None:
    with pytest.raises(InvalidRequest):
        GenerationRequest(messages=None, prompt=None, max_tokens=5)
    with pytest.raises(InvalidRequest):
        GenerationRequest(messages=({"role": "user", "content": "hi"},), prompt="hi", max_tokens=5)
    assert GenerationRequest(messages=None, prompt="hi", max_tokens=5).is_chat is False


def test_request_rejects_non_positive_max_tokens() -> None:
    with pytest.raises(InvalidRequest) as caught:
        GenerationRequest(messages=None, prompt="hi", max_tokens=0)
    assert caught.value.param == "max_tokens"


def test_meter_reports_tokens_over_the_window() -> None:
    meter = DecodeRateMeter(window_s=4.0, bucket_s=0.5)
    for step in range(40):  # 10 tokens/s for 4 s
        meter.record(100.0 + step * 0.1)
    assert meter.rate(104.0) == pytest.approx(10.0, rel=0.15)


def test_meter_forgets_tokens_older_than_the_window() -> None:
    meter = DecodeRateMeter(window_s=2.0, bucket_s=0.25)
    meter.record(10.0, tokens=50)
    assert meter.rate(10.5) == 25.0
    assert meter.rate(12.5) == 0.0


def test_meter_is_zero_before_any_token() -> None:
    assert DecodeRateMeter().rate(0.0) == 0.0


@pytest.mark.anyio
async def test_pool_hands_slots_out_first_come_first_served() -> None:
    pool = SlotPool(["only"])
    held = await pool.acquire()
    order: list[int] = []

    async def wait_turn(number: int) -> None:
        slot = await pool.acquire()
        order.append(number)
        pool.release(slot)

    async with anyio.create_task_group() as tasks:
        for number in range(3):
            tasks.start_soon(wait_turn, number)
            await anyio.wait_all_tasks_blocked()
        assert (pool.in_use, pool.waiting) == (1, 3)
        pool.release(held)
    assert order == [0, 1, 2]
    assert (pool.in_use, pool.waiting) == (0, 0)


@pytest.mark.anyio
async def test_pool_waiter_cancelled_while_queued_leaves_the_queue() -> None:
    pool = SlotPool(["only"])
    held = await pool.acquire()
    with anyio.move_on_after(0.01):
        await pool.acquire()
    assert pool.waiting == 0
    pool.release(held)
    assert pool.in_use == 0


@pytest.mark.anyio
async def test_pool_slot_granted_to_a_cancelled_waiter_passes_to_the_next() -> None:
    pool = SlotPool(["only"])
    held = await pool.acquire()
    got: list[str] = []

    async def acquire_and_keep() -> None:
        got.append(await pool.acquire())

    doomed_scope = anyio.CancelScope()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_acquire_in_scope, pool, doomed_scope)
        await anyio.wait_all_tasks_blocked()
        tasks.start_soon(acquire_and_keep)
        await anyio.wait_all_tasks_blocked()
        doomed_scope.cancel()  # the first waiter is cancelled ...
        pool.release(held)  # ... and granted the slot before it gets to run
    assert got == ["only"]
    assert (pool.in_use, pool.waiting) == (1, 0)


async def _acquire_in_scope(pool: SlotPool[str], scope: anyio.CancelScope) -> None:
    with scope:
        await pool.acquire()
        pytest.fail("a cancelled waiter must not end up holding the slot")


class _Scripted(GenerationStreamBase):
    """A stream of given events that records whether it was closed."""

    def __init__(self, events: list[GenerationEvent]) -> None:
        self._events = list(events)
        self.closed = False

    async def __anext__(self) -> GenerationEvent:
        if self.closed or not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.anyio
async def test_several_choices_come_one_after_another_with_usage_once() -> None:
    streams = [_Scripted([TokenChunk(t), Finished("stop", 7, n)]) for t, n in (("a", 1), ("bc", 2))]
    events = [e async for e in SeveralChoices(streams[0], [lambda: streams[1]])]
    assert events == [TokenChunk("a"), Finished("stop", 7, 1, choice=0, final=False),
                      TokenChunk("bc", choice=1), Finished("stop", 7, 3, choice=1, final=True)]
    assert all(s.closed for s in streams)


@pytest.mark.anyio
async def test_closing_several_choices_early_starts_no_more() -> None:
    started: list[int] = []

    def later() -> GenerationStream:
        started.append(1)
        return _Scripted([])

    first = _Scripted([TokenChunk("a"), Finished("stop", 7, 1)])
    choices = SeveralChoices(first, [later])
    assert await choices.__anext__() == TokenChunk("a")
    await choices.aclose()
    assert first.closed and not started
