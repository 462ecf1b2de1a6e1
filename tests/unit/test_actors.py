"""The supervised-actor runtime, in isolation and in real (small) time."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgerow.actors import Actor, ActorRef, ActorState, RestartPolicy, RestartTracker, Supervisor
from hedgerow.errors import ActorDead, AskTimeout, MailboxFull

pytestmark = pytest.mark.anyio

FAST = RestartPolicy(backoff_initial=0.001, backoff_max=0.01, max_restarts=3, window=10.0)


async def wait_until(predicate: Callable[[], bool], timeout: float = 1.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.001)


class Recorder(Actor):
    """Logs what it is told; answers asks; crashes when told "boom"."""

    starts: list[float]
    stops: int

    def __init__(self, starts: list[float] | None = None) -> None:
        self.log: list[Any] = []
        self.starts = starts if starts is not None else []
        self.release = anyio.Event()
        self.busy = anyio.Event()

    async def on_start(self) -> None:
        self.starts.append(anyio.current_time())

    async def receive(self, message: Any) -> Any:
        if message == "boom":
            raise RuntimeError("boom")
        if message == "log":
            return list(self.log)
        if message == "fail":
            raise ValueError("cannot do that")
        if message == "block":
            self.busy.set()
            await self.release.wait()
            return "released"
        self.log.append(message)
        return None


async def test_ask_returns_what_receive_returns_after_earlier_tells_in_order() -> None:
    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(Recorder, name="recorder")
        for number in range(10):
            ref.tell_nowait(number)
            await ref.tell(f"t{number}")
        log = await ref.ask("log")
    assert log == [item for n in range(10) for item in (n, f"t{n}")]


async def test_spawn_returns_only_once_on_start_has_completed() -> None:
    class SlowStarter(Actor):
        async def on_start(self) -> None:
            await anyio.sleep(0.05)
            self.ready = True

        async def receive(self, message: Any) -> Any:
            return self.ready

    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(SlowStarter, name="slow")
        assert ref.state is ActorState.RUNNING
        assert await ref.ask("ready?") is True


async def test_ask_times_out_with_ask_timeout() -> None:
    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(Recorder, name="recorder")
        started = anyio.current_time()
        with pytest.raises(AskTimeout, match="recorder"):
            await ref.ask("block", timeout=0.05)
        assert anyio.current_time() - started < 0.5
        assert ref.statistics().pending_asks == 0


async def test_timeout_error_raised_by_receive_reaches_asker_unchanged() -> None:
    class TimesOut(Actor):
        async def receive(self, message: Any) -> Any:
            raise TimeoutError("upstream too slow")

    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(TimesOut, name="times-out")
        with pytest.raises(TimeoutError, match="upstream too slow") as caught:
            await ref.ask("x")
        assert not isinstance(caught.value, AskTimeout)


async def test_exception_in_ask_goes_to_asker_and_actor_keeps_its_state() -> None:
    starts: list[float] = []
    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(lambda: Recorder(starts), name="recorder")
        await ref.tell("kept")
        with pytest.raises(ValueError, match="cannot do that"):
            await ref.ask("fail")
        assert await ref.ask("log") == ["kept"]
    assert len(starts) == 1
    assert ref.restarts == 0


async def test_crash_on_tell_restarts_fresh_instance_and_delivers_messages_told_meanwhile(
    caplog: pytest.LogCaptureFixture,
) -> None:
    starts: list[float] = []
    policy = RestartPolicy(backoff_initial=0.05, max_restarts=3)
    async with Supervisor(policy) as supervisor:
        ref = await supervisor.spawn(lambda: Recorder(starts), name="recorder")
        await ref.tell("before")
        await ref.tell("boom")
        await wait_until(lambda: ref.state is ActorState.RESTARTING)
        ref.tell_nowait("during-1")
        await ref.tell("during-2")
        assert await ref.ask("log") == ["during-1", "during-2"]  # "before" died with the old instance
        assert len(starts) == 2
        assert ref.restarts == 1
        assert ref.state is ActorState.RUNNING
    crash = next(r for r in caplog.records if r.name == "hedgerow.actors" and r.levelno == logging.WARNING)
    assert "recorder" in crash.getMessage()
    assert crash.exc_info is not None and str(crash.exc_info[1]) == "boom"


async def test_restart_backoff_grows_exponentially() -> None:
    crash_times: list[float] = []
    starts: list[float] = []

    class FailsToRestart(Recorder):
        async def on_start(self) -> None:
            await super().on_start()
            if 2 <= len(starts) <= 4:
                crash_times.append(anyio.current_time())
                raise ConnectionError("dependency down")

    policy = RestartPolicy(backoff_initial=0.02, backoff_factor=2.0, backoff_max=1.0, max_restarts=10)
    async with Supervisor(policy) as supervisor:
        ref = await supervisor.spawn(lambda: FailsToRestart(starts), name="flaky")
        crash_times.append(anyio.current_time())
        await ref.tell("boom")
        assert await ref.ask("log", timeout=2.0) == []
    gaps = [start - crash for crash, start in zip(crash_times, starts[1:], strict=True)]
    assert ref.restarts == 4
    for gap, expected in zip(gaps, [0.02, 0.04, 0.08, 0.16], strict=True):
        assert expected - 0.002 <= gap < expected + 0.1
    assert gaps[3] > gaps[2] > gaps[1] > gaps[0]


def test_restart_tracker_doubles_caps_resets_and_gives_up() -> None:
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=5.0, backoff_factor=2.0,
                           reset_after=30.0, max_restarts=5, window=100.0)
    tracker = RestartTracker(policy)
    delays = [tracker.on_crash(now=float(t), started_at=float(t)) for t in range(4)]
    assert delays == [1.0, 2.0, 4.0, 5.0]
    assert tracker.on_crash(now=40.0, started_at=5.0) == 1.0  # stayed up 35 s: backoff resets
    assert tracker.on_crash(now=41.0, started_at=41.0) is None  # sixth crash within 100 s
    assert RestartTracker(policy).on_crash(now=500.0, started_at=500.0) == 1.0


@given(st.lists(st.floats(min_value=0.0, max_value=50.0), min_size=1, max_size=30))
def test_restart_tracker_gives_up_exactly_when_window_overflows(gaps: list[float]) -> None:
    policy = RestartPolicy(backoff_initial=0.1, backoff_max=3.0, max_restarts=4, window=20.0)
    tracker, now, crashes = RestartTracker(policy), 0.0, []
    for gap in gaps:
        now += gap
        crashes.append(now)
        delay = tracker.on_crash(now=now, started_at=now)
        in_window = [t for t in crashes if t > now - policy.window]
        if len(in_window) > policy.max_restarts:
            assert delay is None
            return
        assert delay is not None and policy.backoff_initial <= delay <= policy.backoff_max


async def test_too_many_crashes_mark_actor_dead_without_stopping_the_supervisor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = RestartPolicy(backoff_initial=0.001, max_restarts=2, window=10.0)
    async with Supervisor(policy) as supervisor:
        doomed = await supervisor.spawn(Recorder, name="doomed")
        healthy = await supervisor.spawn(Recorder, name="healthy")
        for _ in range(3):
            doomed.tell_nowait("boom")
        with pytest.raises(ActorDead, match="doomed"):
            await doomed.ask("log")  # queued behind the fatal crashes
        assert doomed.state is ActorState.DEAD
        with pytest.raises(ActorDead):
            await doomed.ask("log")
        with pytest.raises(ActorDead):
            doomed.tell_nowait("hello")
        await healthy.tell("still here")
        assert await healthy.ask("log") == ["still here"]
    assert any(r.levelno == logging.ERROR and "doomed" in r.getMessage() for r in caplog.records)


async def test_spawn_raises_actor_dead_when_on_start_keeps_failing() -> None:
    class NeverStarts(Actor):
        async def on_start(self) -> None:
            raise ConnectionError("no database")

    async with Supervisor(FAST) as supervisor:
        with pytest.raises(ActorDead, match="never started"):
            await supervisor.spawn(NeverStarts, name="never")
        assert [s.state for s in supervisor.statistics()] == [ActorState.DEAD]


async def test_shutdown_fails_pending_asks_promptly_and_runs_on_stop() -> None:
    outcomes: dict[str, BaseException | None] = {}
    actors: list[Recorder] = []
    stopped: list[str] = []

    class Stoppable(Recorder):
        async def on_stop(self) -> None:
            stopped.append("stopped")

    def build() -> Recorder:
        actors.append(Stoppable())
        return actors[-1]

    async def ask_and_record(ref: ActorRef, message: str) -> None:
        try:
            outcomes[message] = await ref.ask(message, timeout=10.0)
        except ActorDead as error:
            outcomes[message] = error

    async with anyio.create_task_group() as askers:
        async with Supervisor(FAST) as supervisor:
            ref = await supervisor.spawn(build, name="busy")
            askers.start_soon(ask_and_record, ref, "block")
            await actors[0].busy.wait()
            askers.start_soon(ask_and_record, ref, "log")
            await wait_until(lambda: ref.statistics().mailbox_used == 1)
        left_at = anyio.current_time()
    assert anyio.current_time() - left_at < 0.5
    assert isinstance(outcomes["block"], ActorDead)  # in progress
    assert isinstance(outcomes["log"], ActorDead)  # still in the mailbox
    assert stopped == ["stopped"]
    assert ref.state is ActorState.STOPPED
    with pytest.raises(ActorDead, match="stopped"):
        await ref.ask("log")


async def test_asks_fail_before_a_slow_on_stop_which_is_bounded_by_stop_timeout() -> None:
    actors: list[Recorder] = []
    failed_at: list[float] = []

    class HangsOnStop(Recorder):
        async def on_stop(self) -> None:
            await anyio.sleep_forever()

    def build() -> Recorder:
        actors.append(HangsOnStop())
        return actors[-1]

    async def ask_blocked(ref: ActorRef) -> None:
        with pytest.raises(ActorDead):
            await ref.ask("block", timeout=10.0)
        failed_at.append(anyio.current_time())

    async with anyio.create_task_group() as askers:
        async with Supervisor(FAST, stop_timeout=0.3) as supervisor:
            ref = await supervisor.spawn(build, name="hangs")
            askers.start_soon(ask_blocked, ref)
            await actors[0].busy.wait()
            left_at = anyio.current_time()
        stopped_at = anyio.current_time()
    assert failed_at[0] - left_at < 0.1
    assert 0.29 <= stopped_at - left_at < 1.0


async def test_tell_blocked_on_full_mailbox_fails_with_actor_dead_on_shutdown() -> None:
    actors: list[Recorder] = []
    outcome: list[BaseException] = []

    def build() -> Recorder:
        actors.append(Recorder())
        return actors[-1]

    async def tell_blocked(ref: ActorRef) -> None:
        try:
            await ref.tell("no room")
        except ActorDead as error:
            outcome.append(error)

    async with anyio.create_task_group() as senders:
        async with Supervisor(FAST) as supervisor:
            ref = await supervisor.spawn(build, name="full", mailbox_size=1)
            ref.tell_nowait("block")
            await actors[0].busy.wait()
            ref.tell_nowait("queued")
            senders.start_soon(tell_blocked, ref)
            await anyio.sleep(0.01)
            assert not outcome
    assert len(outcome) == 1 and "full" in str(outcome[0])


async def test_full_mailbox_rejects_tell_nowait_and_tell_waits_for_room() -> None:
    actors: list[Recorder] = []

    def build() -> Recorder:
        actors.append(Recorder())
        return actors[-1]

    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(build, name="small", mailbox_size=2)
        ref.tell_nowait("block")
        await actors[0].busy.wait()
        ref.tell_nowait(1)
        ref.tell_nowait(2)
        with pytest.raises(MailboxFull, match="small"):
            ref.tell_nowait(3)
        assert ref.statistics().mailbox_used == 2
        async with anyio.create_task_group() as senders:
            senders.start_soon(ref.tell, 3)
            await anyio.sleep(0.02)
            assert 3 not in actors[0].log
            actors[0].release.set()
        assert await ref.ask("log") == [1, 2, 3]


async def test_on_tick_runs_periodically_also_between_messages() -> None:
    ticks: list[float] = []

    class Heartbeat(Actor):
        tick_interval = 0.01

        async def on_tick(self) -> None:
            ticks.append(anyio.current_time())

        async def receive(self, message: Any) -> Any:
            return len(ticks)

    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(Heartbeat, name="heartbeat")
        for _ in range(15):
            await ref.tell("busy")
            await anyio.sleep(0.01)
        assert await ref.ask("count") >= 8
    gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
    assert min(gaps) >= 0.009


async def test_crash_in_on_tick_restarts_the_actor() -> None:
    starts: list[float] = []

    class BadTick(Recorder):
        tick_interval = 0.01

        async def on_tick(self) -> None:
            if len(starts) == 1:
                raise RuntimeError("tick failed")

    async with Supervisor(FAST) as supervisor:
        ref = await supervisor.spawn(lambda: BadTick(starts), name="ticker")
        await wait_until(lambda: len(starts) == 2 and ref.state is ActorState.RUNNING)
        await anyio.sleep(0.03)
        assert ref.restarts == 1


async def test_run_service_restarts_crashed_coroutine_and_cancels_it_on_exit() -> None:
    calls: list[str] = []

    async def follow_watch_stream() -> None:
        calls.append("run")
        if len(calls) < 3:
            raise ConnectionResetError("stream dropped")
        try:
            await anyio.sleep_forever()
        finally:
            calls.append("cancelled")

    async with Supervisor(FAST) as supervisor:
        service = supervisor.run_service("watch", follow_watch_stream)
        await wait_until(lambda: len(calls) == 3)
        assert service.restarts == 2
        assert service.state is ActorState.RUNNING
    assert calls == ["run", "run", "run", "cancelled"]
    assert service.state is ActorState.STOPPED


async def test_run_service_that_returns_is_done_not_restarted() -> None:
    runs: list[int] = []

    async def one_shot() -> None:
        runs.append(1)

    async with Supervisor(FAST) as supervisor:
        service = supervisor.run_service("one-shot", one_shot)
        await wait_until(lambda: service.state is ActorState.STOPPED)
        await anyio.sleep(0.02)
    assert runs == [1]


async def test_names_are_unique_and_spawn_needs_a_running_supervisor() -> None:
    supervisor = Supervisor(FAST)
    with pytest.raises(RuntimeError, match="not running"):
        await supervisor.spawn(Recorder, name="early")
    async with supervisor:
        await supervisor.spawn(Recorder, name="twin")
        with pytest.raises(ValueError, match="twin"):
            await supervisor.spawn(Recorder, name="twin")
