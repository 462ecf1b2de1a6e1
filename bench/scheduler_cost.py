"""The scheduler's own cost per request, in process: ``submit``, then the
attempt's and the ticket's ``done``, for one model served by two workers
with free slots (the overhead scenario's shape). Best of five runs.

    PYTHONPATH=$PWD .venv/bin/python bench/scheduler_cost.py [REQUESTS]

Run it as a script path to measure another checkout with the same file
(``PYTHONPATH=/path/to/that/tree``).
"""

from __future__ import annotations

import sys
import time

from bench.corridor import POLICY
from gateway.corridor.scheduler import Scheduler
from gateway.corridor.tickets import Ticket
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.scoring import RouteRequest
from tests.support.fake_workers import record

RUNS = 5


def us_per_request(requests: int) -> float:
    records = (record("a", model="m", slots=4), record("b", model="m", slots=4))
    scheduler = Scheduler(POLICY, LatestValue(RegistrySnapshot(version=1, workers=records), 1))
    best = float("inf")
    for _ in range(RUNS):
        started = time.perf_counter()
        for i in range(requests):
            now = time.monotonic()
            ticket = Ticket(request_id=str(i), tenant="local", model="m", arrival=now,
                            due=now + 1.0, deadline=now + 30.0, estimated_tokens=10,
                            route=RouteRequest(10), hedgeable=False)
            scheduler.submit(ticket, now)
            worker = ticket.assignment.worker
            if worker is None:
                raise RuntimeError("a free worker was not assigned")
            scheduler.attempt_done(worker.registration.worker_id, "success", now)
            scheduler.ticket_done(ticket, 10, now)
        best = min(best, (time.perf_counter() - started) / requests * 1e6)
    return best


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    print(f'{{"requests": {count}, "us_per_request": {us_per_request(count):.1f}}}')
