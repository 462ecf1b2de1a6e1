"""What tracing costs the request corridor: CPU per streamed miss, off vs on.

The corridor of ``bench/corridor.py`` (generation → dispatcher → scheduler →
attempt → relay into the stream log, against in-memory fake workers), each
request inside its request span as ``GatewayApp._complete`` opens it. Rounds
alternate in one process, so load on the machine falls on every mode alike:

- ``off``: tracing not set up (the default): every seam is the no-op check;
- ``sdk``: the SDK on, spans batched to an exporter that drops them (the
  cost of making spans, without encoding them);
- ``otlp``: the SDK on, spans batched to the real OTLP/HTTP exporter, posting
  protobuf to a receiver in a child process (its CPU is not counted; the
  exporter's thread in this process is: ``time.process_time``);
- ``otlp_10pct``: as ``otlp``, with ``OTEL_TRACES_SAMPLER=traceidratio`` and
  ``OTEL_TRACES_SAMPLER_ARG=0.1`` (a tenth of the requests recorded).

    PYTHONPATH=$PWD .venv/bin/python bench/tracing_cost.py 1000 5   # requests per round, rounds
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio

from bench.corridor import BODY, POLICY
from gateway.corridor.attempt import UpstreamCall
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.generation import Generation
from gateway.corridor.scheduler import Scheduler
from gateway.corridor.scheduling import SchedulerClock, SchedulerDoor
from gateway.corridor.stream_log import StreamLog
from gateway.corridor.tickets import Ticket
from gateway.upstream.client import WorkerClient
from hedgerow import tracing
from hedgerow.actors import Supervisor
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.scoring import RouteRequest
from tests.support.fake_workers import Behaviour, FakeWorkers, record

MODES = ("off", "sdk", "otlp", "otlp_10pct")
HEADERS = [(b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]

RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


class Dropping:
    """A span exporter that keeps nothing (the ``sdk`` mode)."""

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def switch(mode: str, endpoint: str) -> None:
    tracing.shutdown()  # flushes the last round's batch
    # The SDK reads the sampler from the environment as a provider is made.
    if mode == "otlp_10pct":
        os.environ.update(OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="0.1")
    else:
        os.environ.pop("OTEL_TRACES_SAMPLER", None)
        os.environ.pop("OTEL_TRACES_SAMPLER_ARG", None)
    if mode == "sdk":
        tracing.setup("bench", exporter=Dropping(), batch=True, env={})
    elif mode.startswith("otlp"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        tracing.setup("bench", exporter=OTLPSpanExporter(endpoint=endpoint + "/v1/traces"),
                      batch=True, env={})


async def measure(per_round: int, rounds: int, endpoint: str) -> dict[str, Any]:
    workers = FakeWorkers({"a": Behaviour(), "b": Behaviour()})
    records = (record("a", model="m", slots=4), record("b", model="m", slots=4))
    directory = LatestValue(RegistrySnapshot(version=1, workers=records), 1)
    client = WorkerClient(POLICY.timeouts, transport=workers.transport())
    ids = itertools.count()
    cpu_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        async with Supervisor() as supervisor:
            plain = Scheduler(POLICY, directory)
            supervisor.run_service("scheduler-clock", SchedulerClock(plain).run)
            door, dispatcher = SchedulerDoor(plain), Dispatcher(plain, client, POLICY)

            async def one() -> None:
                now = time.monotonic()
                ticket = Ticket(request_id=f"r{next(ids)}", tenant="local", model="m",
                                arrival=now, due=now + 5, deadline=now + 60,
                                estimated_tokens=24, route=RouteRequest(8), hedgeable=False)
                stream = StreamLog(ticket.request_id, "local", 1 << 20)
                call = UpstreamCall(ticket.request_id, "/v1/chat/completions", BODY, "m")
                with tracing.server_span("chat", HEADERS, None):
                    outcome = await Generation(door, dispatcher, stream, ticket, call).run()
                if not outcome.complete:
                    raise RuntimeError(f"request {ticket.request_id} did not complete")

            for mode in MODES:  # warm-up, each mode
                switch(mode, endpoint)
                for _ in range(50):
                    await one()
            for _ in range(rounds):
                for mode in MODES:
                    switch(mode, endpoint)
                    cpu = time.process_time()
                    for _ in range(per_round):
                        await one()
                    tracing.shutdown()  # the round's spans exported: counted in it
                    cpu_ms[mode].append((time.process_time() - cpu) * 1000 / per_round)
    finally:
        await client.aclose()
        tracing.shutdown()
    medians = {mode: statistics.median(values) for mode, values in cpu_ms.items()}
    return {
        "requests_per_round": per_round, "rounds": rounds,
        "cpu_ms_per_request_median": {m: round(v, 4) for m, v in medians.items()},
        "cpu_ms_per_request_rounds": {m: [round(v, 4) for v in vs] for m, vs in cpu_ms.items()},
        "added_ms_vs_off": {m: round(medians[m] - medians["off"], 4) for m in MODES[1:]},
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    # Every span of a round reaches the exporter (the default queue, 2048, drops
    # the excess under this closed loop, which would flatter the ``otlp`` mode).
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "100000")
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert receiver.stdout is not None
        endpoint = f"http://127.0.0.1:{receiver.stdout.readline().strip()}"
        result = anyio.run(measure, int(sys.argv[1]), int(sys.argv[2]), endpoint)
    finally:
        receiver.terminate()
        receiver.wait()
    result["utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
