"""The request corridor's own CPU per streamed miss, in one process.

Streamed misses go through ``Generation`` → ``Dispatcher`` → the scheduler
(with its clock task under a real ``Supervisor``), against in-memory fake
workers (``tests.support.fake_workers``): no sockets, no TLS, no HTTP
server, so what is measured is admission, queueing, dispatch, the attempt
and the relay into the stream log, plus the fake worker's own small cost
(the same on both sides of a comparison). Closed loop, ``STREAMS`` lanes.

    PYTHONPATH=$PWD .venv/bin/python bench/corridor.py 3000 1    # requests, streams
    PYTHONPATH=$PWD .venv/bin/python bench/corridor.py 600 1 256 app profile

Optional: the answer's length in tokens (default 3); ``app`` to drive the
whole ``GatewayApp`` through an in-memory ASGI client (admission, the
stream log, the reader writing SSE to the client; the server's disconnect hook)
instead of ``Generation`` alone; ``profile`` to print the top of a cProfile
of the measured part; ``gc`` to tune the collector first as ``hedgerow
gateway`` does (``hedgerow.gc_tuning``; without it, CPython's defaults).
``cpu_us_per_token`` is CPU per request over tokens.

    PYTHONPATH=$PWD .venv/bin/python bench/corridor.py 3000 100 8 app      # defaults
    PYTHONPATH=$PWD .venv/bin/python bench/corridor.py 3000 100 8 app gc   # as shipped

Run it as a script path (not ``-m``) to measure another checkout with the
same file: ``PYTHONPATH=/path/to/that/tree .venv/bin/python bench/corridor.py``.
Trees before the scheduler became a plain object (an actor behind a
mailbox) are driven through their ``SchedulerActor``; that is the only
difference between the two sides.
"""

from __future__ import annotations

import itertools
import os
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
    "cache": {"enabled": False},
    "anonymous_tenant": "local",
    "classes": [{"name": "interactive", "ttft_slo_ms": 1000, "deadline_ms": 60000,
                 "hedge": False}],
    "tenants": [{"name": "local", "class": "interactive",
                 "limits": {"requests_per_s": 1_000_000, "requests_burst": 1_000_000,
                            "tokens_per_min": 10**12, "tokens_burst": 10**11,
                            "max_concurrency": 100_000}}],
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


class _Client:
    """An ASGI client that sends one body and keeps only the byte count."""

    def __init__(self, body: bytes) -> None:
        self.body, self.read, self.bytes, self.status = body, False, 0, 0
        self.gone = anyio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.bytes += len(message.get("body", b""))


SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
         "headers": [(b"content-type", b"application/json")], "query_string": b"",
         "http_version": "1.1"}


def _scope() -> dict[str, Any]:
    """A request's scope; with the ``hedgerow.disconnect`` extension, as the
    gateway's hypercorn gives it, in trees that have it."""
    scope: dict[str, Any] = dict(SCOPE)
    try:
        from hedgerow.http_stack.disconnect_hook import EXTENSION, Disconnect
    except ImportError:  # an older tree: its app watches receive() in a task
        return scope
    scope["extensions"] = {EXTENSION: Disconnect()}
    return scope


async def measure(total: int, streams: int, tokens: int = 3, app: bool = False,
                  profile: bool = False) -> dict[str, Any]:
    answer = Behaviour(tokens=tuple(f" w{i}" for i in range(tokens)))
    workers = FakeWorkers({"a": answer, "b": answer})
    records = (record("a", model="m", slots=streams), record("b", model="m", slots=streams))
    directory = LatestValue(RegistrySnapshot(version=1, workers=records), 1)
    client = WorkerClient(POLICY.timeouts, transport=workers.transport())
    ids = itertools.count()
    try:
        async with Supervisor() as supervisor:
            door, scheduler, shape = await _scheduler(supervisor, directory)
            dispatcher = Dispatcher(scheduler, client, POLICY)

            gateway = None
            if app:
                from gateway.app import GatewayApp

                gateway = GatewayApp(POLICY, directory, door, dispatcher)
                client_body = orjson.dumps({"model": "m", "stream": True, "messages": [
                    {"role": "user", "content": "hi"}]})

            async def one_through_app() -> None:
                assert gateway is not None
                client = _Client(client_body)
                await gateway(_scope(), client.receive, client.send)
                if client.status != 200 or not client.bytes:
                    raise RuntimeError(f"the app answered {client.status}")

            async def one() -> None:
                if app:
                    await one_through_app()
                    return
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
            profiler = None
            if profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            cpu, wall = time.process_time(), time.perf_counter()
            await run(total // streams)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            if profiler is not None:
                import pstats

                profiler.disable()
                pstats.Stats(profiler, stream=sys.stderr).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(int(os.environ.get("PROFILE_TOP", "25")))
    finally:  # (leaving the supervisor stopped the clock task)
        await client.aclose()
    done = (total // streams) * streams
    return {"shape": shape, "streams": streams, "requests": done, "tokens": tokens,
            "through": "app" if app else "generation",
            "cpu_ms_per_request": round(cpu * 1000 / done, 4),
            "cpu_us_per_token": round(cpu * 1e6 / done / tokens, 2),
            "requests_per_s": round(done / wall, 1)}


if __name__ == "__main__":
    args = sys.argv[1:]
    if "gc" in args[3:]:
        from hedgerow.gc_tuning import tune_for_serving

        tune_for_serving()
    print(json.dumps(anyio.run(measure, int(args[0]), int(args[1]),
                               int(args[2]) if len(args) > 2 else 3, "app" in args[3:],
                               "profile" in args[3:])))
