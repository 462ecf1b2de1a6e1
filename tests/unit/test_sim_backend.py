"""The simulated backend: latency model, failure injection, and the GenerationStream contract."""

from __future__ import annotations

import random
import time
from contextlib import aclosing

import anyio
import anyio.lowlevel
import pytest

from hedgerow.errors import HedgerowError
from workers.backend import Finished, GenerationEvent, GenerationRequest, GenerationStream, TokenChunk
from workers.sim_backend import (
    LatencyModel,
    SimBackend,
    SimulatedFailure,
    SimulatedStreamBreak,
    SlowPeriods,
    draw_fate,
    estimate_prompt_tokens,
)


class VirtualTime:
    """A sleep that records how long it was asked to sleep and advances a clock instead."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()

    def clock(self) -> float:
        return self.now


def chat(content: str = "x" * 400, max_tokens: int | None = 5) -> GenerationRequest:
    return GenerationRequest(messages=({"role": "user", "content": content},), prompt=None,
                             max_tokens=max_tokens)


def backend(latency: LatencyModel, vt: VirtualTime, slots: int = 1, seed: int = 7) -> SimBackend:
    return SimBackend("sim-model", slots, latency, seed, sleep=vt.sleep, clock=vt.clock)


async def drain(events: GenerationStream) -> list[GenerationEvent]:
    async with aclosing(events) as stream:
        return [event async for event in stream]


FLAT = LatencyModel(prefill_ms_per_token=2.0, decode_ms_per_token=10.0)


@pytest.mark.anyio
async def test_first_token_after_prefill_then_one_decode_step_per_token() -> None:
    vt = VirtualTime()
    events = await drain(backend(FLAT, vt).generate(chat("x" * 400, max_tokens=5)))
    assert vt.sleeps == pytest.approx([0.2, 0.01, 0.01, 0.01, 0.01])  # 100 prompt tokens × 2 ms
    assert [e.text for e in events[:-1]] == ["tok1 ", "tok2 ", "tok3 ", "tok4 ", "tok5 "]  # type: ignore[union-attr]
    assert events[-1] == Finished("length", prompt_tokens=100, completion_tokens=5)


@pytest.mark.anyio
async def test_without_max_tokens_the_model_stops_after_output_tokens() -> None:
    vt = VirtualTime()
    latency = LatencyModel(output_tokens=3)
    events = await drain(backend(latency, vt).generate(chat(max_tokens=None)))
    assert events[-1] == Finished("stop", prompt_tokens=100, completion_tokens=3)
    assert sum(isinstance(e, TokenChunk) for e in events) == 3


def test_prompt_tokens_are_estimated_at_four_characters_each() -> None:
    assert estimate_prompt_tokens(GenerationRequest(messages=None, prompt="a" * 41, max_tokens=1)) == 10
    two_messages = ({"role": "system", "content": "a" * 20}, {"role": "user", "content": "b" * 20})
    assert estimate_prompt_tokens(GenerationRequest(messages=two_messages, prompt=None, max_tokens=1)) == 10
    assert estimate_prompt_tokens(GenerationRequest(messages=None, prompt="", max_tokens=1)) == 1


@pytest.mark.anyio
async def test_a_straggler_is_slowed_in_prefill_and_decode() -> None:
    vt = VirtualTime()
    latency = LatencyModel(prefill_ms_per_token=2.0, decode_ms_per_token=10.0,
                           straggler_probability=1.0, straggler_factor=10.0)
    await drain(backend(latency, vt).generate(chat(max_tokens=3)))
    assert vt.sleeps == pytest.approx([2.0, 0.1, 0.1])


@pytest.mark.anyio
async def test_a_generation_created_in_a_slow_window_is_slowed_and_one_outside_is_not() -> None:
    periods = SlowPeriods(probability=0.3, seconds=2.0, factor=10.0, seed=5)
    slow_at = next(2.0 * w for w in range(1000) if periods.slow(2.0 * w))
    fast_at = next(2.0 * w for w in range(1000) if not periods.slow(2.0 * w))
    latency = LatencyModel(prefill_ms_per_token=2.0, decode_ms_per_token=10.0)
    for wall, expected in ((slow_at + 1.9, [2.0, 0.1, 0.1]), (fast_at, [0.2, 0.01, 0.01])):
        vt = VirtualTime()
        sim = SimBackend("sim-model", 1, latency, 7, sleep=vt.sleep, clock=vt.clock,
                         slow_periods=periods, wall_clock=lambda: wall)
        await drain(sim.generate(chat(max_tokens=3)))
        assert vt.sleeps == pytest.approx(expected)


def test_slow_windows_follow_the_seed_and_cover_about_their_probability() -> None:
    one, again, other = (SlowPeriods(0.1, 2.0, 10.0, seed) for seed in (3, 3, 4))
    windows = [2.0 * w + 0.5 for w in range(20_000)]
    marks = [one.slow(t) for t in windows]
    assert marks == [again.slow(t) for t in windows]  # another process, same seed: same windows
    assert marks != [other.slow(t) for t in windows]
    assert 0.09 < sum(marks) / len(marks) < 0.11
    assert all(one.slow(t) == one.slow(t + 1.4) for t in windows[:500])  # whole windows


@pytest.mark.parametrize("spec", ["0.1:2", "x:2:10", "1.5:2:10", "0.1:0:10", "0.1:2:0.5"])
def test_slow_periods_refuse_nonsense(spec: str) -> None:
    with pytest.raises(ValueError):
        SlowPeriods.parse(spec)


@pytest.mark.anyio
async def test_jitter_stays_within_its_fraction_and_is_reproducible_by_seed() -> None:
    latency = LatencyModel(prefill_ms_per_token=0.0, decode_ms_per_token=10.0, jitter=0.2)
    runs: list[list[float]] = []
    for seed in (1, 1, 2):
        vt = VirtualTime()
        await drain(backend(latency, vt, seed=seed).generate(chat(max_tokens=50)))
        runs.append(vt.sleeps[1:])
    assert all(0.008 <= s <= 0.012 for s in runs[0])
    assert len(set(runs[0])) > 40, "each step draws its own jitter"
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_failure_probabilities_are_respected_over_many_draws() -> None:
    latency = LatencyModel(failure_probability=0.3, straggler_probability=0.05,
                           mid_stream_failure_probability=0.1)
    rng = random.Random(3)
    fates = [draw_fate(chat(max_tokens=20), latency, rng) for _ in range(4000)]
    assert sum(f.fails_before_first_token for f in fates) / 4000 == pytest.approx(0.3, abs=0.03)
    assert sum(f.slowdown > 1 for f in fates) / 4000 == pytest.approx(0.05, abs=0.015)
    break_points = [f.breaks_after for f in fates if f.breaks_after is not None]
    assert len(break_points) / 4000 == pytest.approx(0.1, abs=0.02)
    assert min(break_points) == 1 and max(break_points) == 20


@pytest.mark.anyio
async def test_failure_before_first_token_raises_a_500_after_the_prefill() -> None:
    vt = VirtualTime()
    sim = backend(LatencyModel(prefill_ms_per_token=1.0, failure_probability=1.0), vt)
    stream = sim.generate(chat("x" * 40))
    with pytest.raises(SimulatedFailure) as caught:
        await drain(stream)
    assert caught.value.status == 500 and isinstance(caught.value, HedgerowError)
    assert not isinstance(caught.value, SimulatedStreamBreak)
    assert vt.sleeps == pytest.approx([0.01])
    load = sim.load()
    assert (load.active, load.generations_total, load.cancelled_total, load.tokens_generated_total) == (0, 1, 0, 0)


@pytest.mark.anyio
async def test_mid_stream_failure_breaks_after_some_tokens() -> None:
    vt = VirtualTime()
    sim = backend(LatencyModel(mid_stream_failure_probability=1.0), vt)
    seen_counts: set[int] = set()
    for _ in range(30):
        received: list[GenerationEvent] = []
        with pytest.raises(SimulatedStreamBreak):
            async with sim.generate(chat(max_tokens=4)) as stream:
                async for event in stream:
                    received.append(event)
        assert all(isinstance(e, TokenChunk) for e in received), "no Finished before the break"
        seen_counts.add(len(received))
    assert seen_counts == {1, 2, 3, 4}
    assert sim.load().active == 0


@pytest.mark.anyio
async def test_slots_are_handed_out_first_come_first_served() -> None:
    sim = SimBackend("m", 1, LatencyModel(prefill_ms_per_token=0, decode_ms_per_token=1))
    holder = sim.generate(chat(max_tokens=1))
    await holder.__anext__()
    order: list[int] = []

    async def wait_for_turn(number: int) -> None:
        async with sim.generate(chat(max_tokens=1)) as stream:
            await stream.__anext__()
            order.append(number)

    async with anyio.create_task_group() as tasks:
        for number in range(3):
            tasks.start_soon(wait_for_turn, number)
            await anyio.wait_all_tasks_blocked()
        assert (sim.load().active, sim.load().queued) == (1, 3)
        await holder.aclose()
    assert order == [0, 1, 2]
    assert (sim.load().active, sim.load().queued) == (0, 0)


@pytest.mark.anyio
async def test_close_from_another_task_stops_a_read_at_once() -> None:
    sim = SimBackend("m", 1, LatencyModel(prefill_ms_per_token=0, decode_ms_per_token=60_000))
    stream = sim.generate(chat(max_tokens=5))
    assert isinstance(await stream.__anext__(), TokenChunk)
    result: list[GenerationEvent] = []

    async def read_one() -> None:
        result.append(await stream.__anext__())

    started = time.monotonic()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(read_one)
        await anyio.wait_all_tasks_blocked()
        await stream.aclose()
        assert sim.load().active == 0, "slot returned before aclose() completes"
    assert time.monotonic() - started < 1.0
    assert result == [Finished("cancelled", prompt_tokens=100, completion_tokens=1)]
    assert (sim.load().generations_total, sim.load().cancelled_total) == (1, 1)
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


@pytest.mark.anyio
async def test_consumer_cancelled_mid_stream_frees_the_slot() -> None:
    sim = SimBackend("m", 1, LatencyModel(prefill_ms_per_token=0, decode_ms_per_token=60_000))
    with anyio.move_on_after(0.05):
        async with sim.generate(chat(max_tokens=5)) as stream:
            async for _ in stream:
                pass
    load = sim.load()
    assert (load.active, load.generations_total, load.cancelled_total, load.tokens_generated_total) == (0, 1, 1, 1)


@pytest.mark.anyio
async def test_closing_a_stream_still_waiting_for_a_slot_leaves_the_queue() -> None:
    sim = SimBackend("m", 1, LatencyModel(prefill_ms_per_token=0, decode_ms_per_token=1))
    holder = sim.generate(chat(max_tokens=1))
    await holder.__anext__()
    waiting = sim.generate(chat(max_tokens=1))
    result: list[GenerationEvent] = []

    async def read_one() -> None:
        result.append(await waiting.__anext__())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(read_one)
        await anyio.wait_all_tasks_blocked()
        assert sim.load().queued == 1
        await waiting.aclose()
    assert result == [Finished("cancelled", prompt_tokens=100, completion_tokens=0)]
    assert (sim.load().queued, sim.load().active) == (0, 1)
    await holder.aclose()
    assert sim.load().active == 0


@pytest.mark.anyio
async def test_a_second_concurrent_reader_is_refused() -> None:
    sim = SimBackend("m", 1, LatencyModel(prefill_ms_per_token=0, decode_ms_per_token=60_000))
    async with sim.generate(chat(max_tokens=5)) as stream:
        await stream.__anext__()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stream.__anext__)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.BusyResourceError):
                await stream.__anext__()
            tasks.cancel_scope.cancel()


@pytest.mark.anyio
async def test_load_counts_tokens_and_decode_rate() -> None:
    vt = VirtualTime()
    sim = backend(LatencyModel(prefill_ms_per_token=0, decode_ms_per_token=100), vt, slots=2)
    for _ in range(2):
        await drain(sim.generate(chat(max_tokens=10)))
    load = sim.load()
    assert (load.slots, load.generations_total, load.tokens_generated_total) == (2, 2, 20)
    assert load.tokens_per_s == pytest.approx(20 / 5.0)  # all within the 5 s window


@pytest.mark.anyio
async def test_real_sleeps_take_about_as_long_as_the_model_says() -> None:
    sim = SimBackend("m", 1, LatencyModel(prefill_ms_per_token=1.0, decode_ms_per_token=5.0))
    started = time.monotonic()
    events = await drain(sim.generate(chat("x" * 80, max_tokens=6)))  # 20 ms + 5 × 5 ms
    elapsed = time.monotonic() - started
    assert len(events) == 7
    assert 0.045 <= elapsed < 1.0


@pytest.mark.parametrize("bad", [
    {"jitter": 1.0}, {"jitter": -0.1}, {"straggler_factor": 0.5}, {"failure_probability": 1.5},
    {"mid_stream_failure_probability": -0.1}, {"decode_ms_per_token": -1}, {"output_tokens": 0},
])
def test_latency_model_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LatencyModel(**bad)  # type: ignore[arg-type]


def test_backend_describes_itself_as_sim() -> None:
    sim = SimBackend("smollm2-135m-instruct", 4, LatencyModel())
    assert (sim.kind, sim.device, sim.models, sim.slots) == ("sim", None, ("smollm2-135m-instruct",), 4)
