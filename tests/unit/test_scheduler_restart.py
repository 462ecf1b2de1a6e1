"""A crash of the scheduler's clock task loses nothing: the queues, the policy in
force and every count live in the ``Scheduler`` object, which the task only
borrows. (When the scheduler was an actor, a crash lost its queues: first the
queued requests waited forever, then each got a 503 ``scheduler_restarted``.)

The clock task runs under a real ``Supervisor``; the crash is a bug in routing
that raises in the middle of a tick's dispatch, with a ticket already taken
off its queue.
"""

from __future__ import annotations

import ast
import inspect

import anyio
import pytest

import gateway.corridor.scheduler
from gateway.corridor.scheduler import Scheduler
from gateway.corridor.scheduling import CLOCK_RESTARTS, SchedulerClock
from gateway.corridor.tickets import QUEUED, Assigned, Ticket
from hedgerow.actors import ActorState, RestartPolicy, RestartTracker, Supervisor
from hedgerow.errors import NoHealthyWorker
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration
from policies.admission import Refused
from policies.schema import Policy
from policies.scoring import RouteRequest

PROMPT_S = 2.0  # generous: the restart backoff is 0.05 s, a tick every 0.02 s


def policy(max_queue: int) -> Policy:
    return Policy.model_validate({"scheduling": {"slo_admission": False, "max_queue": max_queue}})


def worker(wid: str) -> WorkerRecord:
    return WorkerRecord(
        registration=WorkerRegistration(worker_id=wid, url=f"http://{wid}.invalid", kind="cpu",
                                        models=("m",), slots=1),
        load=WorkerLoad(), lease_expires_in_s=30.0)


def ticket(name: str) -> Ticket:
    now = anyio.current_time()
    return Ticket(request_id=name, tenant="local", model="m", arrival=now, due=now + 1.0,
                  deadline=now + 30.0, estimated_tokens=10, route=RouteRequest(10),
                  hedgeable=False)


def worker_of(t: Ticket) -> str | None:
    record = t.assignment.worker
    return None if record is None else record.registration.worker_id


@pytest.mark.anyio
async def test_a_crashed_clock_task_loses_no_queued_request_and_no_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    directory = LatestValue(RegistrySnapshot(version=1, workers=(worker("a"),)), 1)
    scheduler = Scheduler(policy(max_queue=100), directory)
    async with Supervisor(RestartPolicy(backoff_initial=0.05)) as supervisor:
        clock_task = supervisor.run_service(
            "scheduler-clock", SchedulerClock(scheduler, clock=anyio.current_time).run)
        running = ticket("running")
        assert isinstance(scheduler.submit(running, anyio.current_time()), Assigned)
        waiting = [ticket(f"waiting-{n}") for n in range(3)]
        for t in waiting:
            assert scheduler.submit(t, anyio.current_time()) is QUEUED
        scheduler.reconfigure(policy(max_queue=4))  # what the gateway's apply_policy does

        # A routing bug: the next dispatch raises with the head of the queue in hand.
        real_pick = scheduler._pick_queued
        crashes: list[str] = []

        def pick_once_broken(t: Ticket, now: float) -> WorkerRecord | None:
            if not crashes:
                crashes.append(t.request_id)
                raise RuntimeError("injected: a bug in routing")
            return real_pick(t, now)

        monkeypatch.setattr(scheduler, "_pick_queued", pick_once_broken)
        # Worker b joins: the next tick dispatches onto it, crashes, and the restarted
        # task does it again, from the queue kept across the crash.
        directory.publish(RegistrySnapshot(version=2, workers=(worker("a"), worker("b"))), 2)
        with anyio.fail_after(PROMPT_S):
            first = await waiting[0].assignment.wait()
        assert crashes == ["waiting-0"] and first.registration.worker_id == "b"
        assert (clock_task.restarts, clock_task.state) == (1, ActorState.RUNNING)
        assert [worker_of(t) for t in waiting] == ["b", None, None]
        assert scheduler.stats(anyio.current_time())["queued"] == {"m": 2}

        # The rest are served as slots free up, earliest deadline first.
        scheduler.attempt_done("a", "success", anyio.current_time())
        scheduler.ticket_done(running, 4, anyio.current_time())
        assert [worker_of(t) for t in waiting] == ["b", "a", None]

        # The policy applied before the crash is still in force: four queued, no more
        # (the startup policy would have queued 100).
        for n in range(3):
            assert scheduler.submit(ticket(f"more-{n}"), anyio.current_time()) is QUEUED
        refusal = scheduler.submit(ticket("one too many"), anyio.current_time())
        assert isinstance(refusal, Refused)
        assert (refusal.status, refusal.reason) == (503, "queue_full")


def test_the_scheduler_module_does_no_io_and_reads_no_clock() -> None:
    # Sans-IO: time comes in as ``now``; waking a waiter is the ticket's business.
    tree = ast.parse(inspect.getsource(gateway.corridor.scheduler))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not imported & {"anyio", "asyncio", "trio", "time", "socket", "redis", "httpx"}


def test_the_clock_task_is_restarted_however_often_it_crashes() -> None:
    """A default supervisor gives up after six crashes in a minute; the clock
    holds no state, so it is restarted every time, at most a second apart."""
    tracker = RestartTracker(CLOCK_RESTARTS)
    delays = [tracker.on_crash(now=i * 0.5, started_at=i * 0.5) for i in range(1000)]
    assert all(delay is not None and delay <= 1.0 for delay in delays)


@pytest.mark.anyio
async def test_the_clock_sleeps_while_no_ticket_waits_and_wakes_for_one_that_does() -> None:
    """An idle gateway (or one whose requests all find a free slot) runs no tick;
    a ticket left queued wakes the clock, which then sheds it at its deadline."""
    directory = LatestValue(RegistrySnapshot(version=1, workers=(worker("a"),)), 1)
    scheduler = Scheduler(policy(max_queue=100), directory)
    clock = SchedulerClock(scheduler, clock=anyio.current_time)
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        await anyio.sleep(0.2)
        assert clock.ticks == 1  # the first look, then asleep
        running = ticket("running")
        assert isinstance(scheduler.submit(running, anyio.current_time()), Assigned)
        await anyio.sleep(0.1)
        assert clock.ticks == 1  # assigned at once: nothing for a tick to do
        late = ticket("late")
        late.deadline = anyio.current_time() + 0.1
        assert scheduler.submit(late, anyio.current_time()) is QUEUED
        with anyio.fail_after(PROMPT_S), pytest.raises(NoHealthyWorker, match="deadline"):
            await late.assignment.wait()
        assert clock.ticks > 1
        shed = scheduler.stats(anyio.current_time())["counters"]["shed_deadline"]
        assert shed == 1
        ticks = clock.ticks
        await anyio.sleep(0.2)
        assert clock.ticks == ticks  # the tick that shed it left no queue: asleep since
        tg.cancel_scope.cancel()
    assert scheduler.on_queued is None
