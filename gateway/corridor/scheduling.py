"""The scheduler's two ways in: the request path's door, and the clock task.

The scheduler (``gateway.corridor.scheduler.Scheduler``) is a plain object that does
no I/O; this module holds the little that does:

- ``SchedulerDoor`` is what a request calls. Without shared limits each call
  is one synchronous call into the scheduler (the ``async def`` never
  suspends). With ``--redis`` the tenant's shared requests/s and tokens/min
  (``gateway.corridor.shared_limits``) are taken first, which awaits Redis, then the
  scheduler's own admission decides, as before.
- ``SchedulerClock`` calls ``scheduler.tick(now)`` every ``interval_s``
  while a ticket waits in a queue: queued requests past their deadline are
  shed, and queued ones dispatched onto workers that the registry added or
  breakers let back meanwhile. While no queue holds a ticket it sleeps until
  the scheduler says one was left waiting (``Scheduler.on_queued``): an idle
  gateway, or one whose requests all find a free slot at once, runs no tick. It
  runs as a supervised service; when it crashes and is restarted, nothing is
  lost, because the queues, the policy in force and every count live in the
  scheduler, which the task only borrows.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio

from gateway.corridor.scheduler import Scheduler
from gateway.corridor.shared_limits import SharedRequestLimits, add_shared_counters
from gateway.corridor.tickets import Submitted, Ticket
from hedgerow.actors import RestartPolicy
from policies.admission import Refused
from policies.schema import Policy

log = logging.getLogger("hedgerow.gateway.scheduling")

# How late a queued request past its deadline is shed, at most, and how soon a
# worker that joined the registry starts taking queued requests.
TICK_INTERVAL_S = 0.02


class SchedulerDoor:
    """The request path's calls into the scheduler, the shared limits in front."""

    def __init__(self, scheduler: Scheduler, shared: SharedRequestLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.shared = shared
        self.clock = clock

    async def submit(self, ticket: Ticket) -> Submitted:
        """Admit ``ticket`` (assigned or queued) or refuse it."""
        if self.shared is None:
            return self.scheduler.submit(ticket, self.clock())
        refusal = await self.shared.check(ticket)
        if refusal is not None:
            return refusal
        decision = self.scheduler.submit(ticket, self.clock())
        if isinstance(decision, Refused):
            await self.shared.settle(ticket, 0)  # refused here: it never ran
        return decision

    async def charge_request(self, tenant: str, policy: Policy | None, tokens: float = 0.0,
                             request_id: str | None = None) -> Refused | None:
        """Charge one request to ``tenant``'s requests/s (shared, then local) before
        the cache answers it or it joins a flight; its ticket skips that charge.
        ``tokens`` (with the ``request_id`` to settle by): a request served without
        a ticket -- an embedding -- also takes its input tokens from the tenant's
        tokens/min, shared and local; ``settle_request`` corrects them."""
        if self.shared is not None:
            refusal = await self.shared.charge_request(tenant, policy, tokens, request_id)
            if refusal is not None:
                return refusal
        refusal = self.scheduler.charge_request(tenant, self.clock(), tokens)
        if refusal is not None and self.shared is not None and request_id is not None:
            await self.shared.settle_request(request_id, tenant, policy, 0)  # never ran
        return refusal

    async def settle_request(self, tenant: str, policy: Policy | None, request_id: str,
                             estimated: float, actual: float) -> None:
        """A request ``charge_request`` took ``estimated`` tokens for used ``actual``
        (0: it failed; all of its charge goes back)."""
        self.scheduler.settle_tokens(tenant, estimated, actual, self.clock())
        if self.shared is not None:
            await self.shared.settle_request(request_id, tenant, policy, actual)

    async def ticket_done(self, ticket: Ticket, actual_tokens: int) -> None:
        """The request is over: settle its tenant's tokens and concurrency."""
        self.scheduler.ticket_done(ticket, actual_tokens, self.clock())
        if self.shared is not None:
            await self.shared.settle(ticket, actual_tokens)

    def apply_policy(self, policy: Policy) -> None:
        self.scheduler.reconfigure(policy)

    def stats(self) -> dict[str, Any]:
        """The scheduler's snapshot (plus the shared limits' counters) for /metrics."""
        stats = self.scheduler.stats(self.clock())
        if self.shared is not None:
            stats = add_shared_counters(stats, self.shared.counters)
        return stats


# The clock holds no state, so restarting it is always safe, and giving up is
# never: a dead clock would stop shedding queued requests at their deadlines and
# leave hedges unfired. A fault that recurs on every tick is retried at most a
# second apart (and logged by the supervisor each time), never abandoned.
CLOCK_RESTARTS = RestartPolicy(backoff_initial=0.02, backoff_max=1.0, max_restarts=sys.maxsize)


class SchedulerClock:
    """Drives ``scheduler.tick``; owns nothing a restart could lose."""

    def __init__(self, scheduler: Scheduler, interval_s: float = TICK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.interval_s = interval_s
        self.clock = clock
        self.ticks = 0
        self._queued: anyio.Event | None = None  # set while it sleeps on an empty scheduler

    async def run(self) -> None:
        self.scheduler.on_queued = self._wake
        try:
            while True:
                self.scheduler.tick(self.clock())
                self.ticks += 1
                if self.scheduler.waiting():
                    await anyio.sleep(self.interval_s)
                    continue
                self._queued = anyio.Event()
                await self._queued.wait()
        finally:
            self._queued = None
            if self.scheduler.on_queued == self._wake:
                self.scheduler.on_queued = None

    def _wake(self) -> None:
        if self._queued is not None:
            self._queued.set()
