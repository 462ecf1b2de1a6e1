"""The request corridor's own CPU per streamed miss, in one process.

Streamed misses go through ``Generation`` → ``Dispatcher`` → the scheduler
(with its clock task under a real ``Supervisor``), against in-memory fake
workers (``tests.support.fake_workers``): no sockets, no TLS, no HTTP
server, so what is measured is admission, queueing, dispatch, the attempt
and the relay into the stream log, plus the fake worker's own small cost
(the same on both sides of a comparison). Closed loop, ``STREAMS`` lanes.

    PYTHONPATH=$PWD .venv/bin/python bench/corridor.py 3000 1    # requests, streams

Run it as a script path (not ``-m``) to measure another checkout with the
same file: ``PYTHONPATH=/path/to/that/tree .venv/bin/python bench/corridor.py``.
Trees before the scheduler became a plain object (an actor behind a
mailbox) are driven through their ``SchedulerActor``; that is the only
difference between the two sides.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any

import anyio
import orjson

import gateway.corridor.scheduler as scheduler_module
from gateway.corridor.attempt import UpstreamCall
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.generation import Generation
from gateway.corridor.stream_log import StreamLog
from gateway.corridor.tickets import Ticket
from gateway.upstream.client import WorkerClient
from hedgerow.actors import Supervisor
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.schema import Policy
from policies.scoring import RouteRequest
from tests.support.fake_workers import Behaviour, FakeWorkers, record

# As the overhead scenario's: hedging off, limits far above the load.
POLICY = Policy.model_validate({
    "models": [{"name": "m"}],
    "hedging": {"enabled": False},
    "scheduling": {"slo_admission": False, "max_queue": 100_000},
})
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                     "stream": True, "stream_options": {"include_usage": True}})
WARM_UP_PER_STREAM = 20


async def _scheduler(supervisor: Supervisor,
                     directory: LatestValue[RegistrySnapshot]) -> tuple[Any, Any, str]:
    """(what the generation calls, what the dispatcher calls, which shape)."""
    actor = getattr(scheduler_module, "SchedulerActor", None)
    if actor is not None:  # an older tree: the actor behind a mailbox
        ref = await supervisor.spawn(lambda: actor(POLICY, directory), name="scheduler",
                                     mailbox_size=4096)
        return ref, ref, "actor"
    from gateway.corridor.scheduling import SchedulerClock, SchedulerDoor

    plain = scheduler_module.Scheduler(POLICY, directory)
    supervisor.run_service("scheduler-clock", SchedulerClock(plain).run)
    return SchedulerDoor(plain), plain, "object"


async def measure(total: int, streams: int) -> dict[str, Any]:
    workers = FakeWorkers({"a": Behaviour(), "b": Behaviour()})
    records = (record("a", model="m", slots=streams), record("b", model="m", slots=streams))
    directory = LatestValue(RegistrySnapshot(version=1, workers=records), 1)
    client = WorkerClient(POLICY.timeouts, transport=workers.transport())
    ids = itertools.count()
    try:
        async with Supervisor() as supervisor:
            door, scheduler, shape = await _scheduler(supervisor, directory)
            dispatcher = Dispatcher(scheduler, client, POLICY)

            async def one() -> None:
                now = time.monotonic()
                ticket = Ticket(request_id=f"r{next(ids)}", tenant="local", model="m",
                                arrival=now, due=now + 5, deadline=now + 60,
                                estimated_tokens=24, route=RouteRequest(8), hedgeable=False)
                stream = StreamLog(ticket.request_id, "local", 1 << 20)
                call = UpstreamCall(ticket.request_id, "/v1/chat/completions", BODY, "m")
                outcome = await Generation(door, dispatcher, stream, ticket, call).run()
                if not outcome.complete:
                    raise RuntimeError(f"request {ticket.request_id} did not complete")

            async def run(per_stream: int) -> None:
                async def lane() -> None:
                    for _ in range(per_stream):
                        await one()

                async with anyio.create_task_group() as tg:
                    for _ in range(streams):
                        tg.start_soon(lane)

            await run(WARM_UP_PER_STREAM)
            cpu, wall = time.process_time(), time.perf_counter()
            await run(total // streams)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:  # (leaving the supervisor stopped the clock task)
        await client.aclose()
    done = (total // streams) * streams
    return {"shape": shape, "streams": streams, "requests": done,
            "cpu_ms_per_request": round(cpu * 1000 / done, 4),
            "requests_per_s": round(done / wall, 1)}


if __name__ == "__main__":
    print(json.dumps(anyio.run(measure, int(sys.argv[1]), int(sys.argv[2]))))
