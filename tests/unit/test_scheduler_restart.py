"""A crashed scheduler: its waiting requests get a prompt, retryable 503, and the
instance rebuilt in its place runs the policy in force, not the startup one.

The scheduler runs under a real ``Supervisor``; the crash is an unexpected
message told to it (``receive`` raises, as any bug in a tell would).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from gateway.scheduler import SchedulerFactory
from gateway.tickets import AttemptDone, Reconfigure, Stats, Submit, Ticket, TicketDone
from hedgerow.actors import ActorRef, ActorState, RestartPolicy, Supervisor
from hedgerow.errors import NoHealthyWorker
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration
from policies.admission import Refused
from policies.schema import Policy
from policies.scoring import RouteRequest

PROMPT_S = 1.0  # a waiting request hears of the crash within this (the restart backoff is 0.05 s)


def policy(max_queue: int) -> Policy:
    return Policy.model_validate({"scheduling": {"slo_admission": False, "max_queue": max_queue}})


def one_worker() -> LatestValue[RegistrySnapshot]:
    record = WorkerRecord(
        registration=WorkerRegistration(worker_id="a", url="http://a.invalid", kind="cpu",
                                        models=("m",), slots=1),
        load=WorkerLoad(), lease_expires_in_s=30.0)
    return LatestValue(RegistrySnapshot(version=1, workers=(record,)), 1)


def ticket(name: str) -> Ticket:
    now = anyio.current_time()
    return Ticket(request_id=name, tenant="local", model="m", arrival=now, due=now + 1.0,
                  deadline=now + 30.0, estimated_tokens=10, route=RouteRequest(10),
                  hedgeable=False)


async def submit(ref: ActorRef, t: Ticket) -> Refused | None:
    reply: Refused | None = await ref.ask(Submit(t))
    return reply


async def stats(ref: ActorRef) -> dict[str, Any]:
    reply: dict[str, Any] = await ref.ask(Stats())  # answered after every earlier tell
    return reply


@pytest.mark.anyio
async def test_a_crash_refuses_waiting_requests_promptly_and_the_rebuilt_scheduler_runs_the_latest_policy(
) -> None:
    factory = SchedulerFactory(policy(max_queue=100), one_worker(), clock=anyio.current_time)
    async with Supervisor(RestartPolicy(backoff_initial=0.05)) as supervisor:
        ref = await supervisor.spawn(factory, name="scheduler")
        running = ticket("running")
        assert await submit(ref, running) is None
        assert running.assignment.worker is not None  # on the only worker's only slot
        waiting = [ticket(f"waiting-{n}") for n in range(3)]
        for t in waiting:
            assert await submit(ref, t) is None
        assert not any(t.assignment.settled for t in waiting)

        latest = policy(max_queue=1)  # what the gateway's apply_policy does
        factory.apply_policy(latest)
        await ref.tell(Reconfigure(latest))
        await ref.tell(object())  # crash

        started = anyio.current_time()
        with anyio.fail_after(PROMPT_S):
            for t in waiting:
                with pytest.raises(NoHealthyWorker) as refused:
                    await t.assignment.wait()
                error = refused.value
                assert (error.status, error.code) == (503, "scheduler_restarted")
                assert (b"retry-after", b"1") in error.headers()
        assert anyio.current_time() - started < PROMPT_S

        # The request that was on the worker when it crashed ends on the new instance:
        # its end frees the slot and does not crash it (it never admitted that request).
        await ref.tell(AttemptDone("a", "success"))
        await ref.tell(TicketDone(running, 4))
        current = await stats(ref)
        assert current["queued"] == {} and current["inflight"] == {}
        assert factory.built == 2
        assert [(c.state, c.restarts) for c in supervisor.statistics()] == [
            (ActorState.RUNNING, 1)]

        # The rebuilt scheduler queues one request, as the latest policy says (the
        # startup policy would have queued 100).
        assert await submit(ref, ticket("served")) is None
        assert await submit(ref, ticket("queued")) is None
        refusal = await submit(ref, ticket("one too many"))
        assert refusal is not None and (refusal.status, refusal.reason) == (503, "queue_full")
