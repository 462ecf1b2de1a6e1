"""Getting a request's first token: queue, attempt, retry, hedge.

``Dispatcher.first_token`` waits for the scheduler to assign a worker, starts
the attempt, and races it against time: if no first token has come after the
pool's hedge delay (its live TTFT quantile, within the policy's floor and
ceiling) and the hedge budget allows, the same request starts on a second
worker; the first attempt to produce a token wins and the other is cancelled,
which closes its connection and stops its worker. The primary runs in the
caller's task; only the hedge, when one starts, gets a task of its own. An attempt that fails before
its first token is retried on another worker (``retries.before_first_token``
times), invisibly to the client; when no other worker is free, the request
waits in its queue again, as it did for its first worker (shed at its
deadline). Every attempt reports exactly one ``attempt_done`` to the scheduler.

The scheduler is called directly (it does no I/O and never awaits), so none of
these calls can be lost to cancellation or wait behind other requests' calls.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from gateway.corridor.attempt import Attempt, UpstreamCall, start_attempt
from gateway.corridor.scheduler import Scheduler
from gateway.corridor.tickets import Outcome, Requeued, Ticket
from gateway.upstream.client import WorkerClient
from hedgerow import tracing
from hedgerow.tracing import AttributeValue
from hedgerow.errors import HedgerowError, NoHealthyWorker, UpstreamFailed, UpstreamRejected
from hedgerow.wire import WorkerRecord
from policies.schema import Policy

log = logging.getLogger("hedgerow.gateway.dispatch")

AttemptResult = Attempt | HedgerowError
AttemptKind = Literal["primary", "hedge", "retry"]


@dataclass
class _Race:
    ticket: Ticket
    call: UpstreamCall
    tried: list[str]
    running: int = 0
    hedged: bool = False
    retries: int = 0
    winner: Attempt | None = None
    rejected: bool = False  # the hedge was refused: no other worker is tried
    errors: list[HedgerowError] = field(default_factory=list)


@dataclass
class _Hedge:
    """A race's hedge: the timer that starts it, and its end."""

    timer: asyncio.TimerHandle | None = None
    done: anyio.Event | None = None  # set when the hedge's task has ended

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Dispatcher:
    def __init__(self, scheduler: Scheduler, workers: WorkerClient, policy: Policy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler = scheduler
        self.workers = workers
        self.policy = policy
        self.clock = clock

    def _policy(self, ticket: Ticket) -> Policy:
        """The policy the request started under."""
        return self.policy if ticket.policy is None else ticket.policy

    def report(self, worker_id: str, outcome: Outcome) -> None:
        """Tell the scheduler an attempt ended (a plain call: cancellation can't lose it)."""
        self.scheduler.attempt_done(worker_id, outcome, self.clock())

    async def assigned_worker(self, ticket: Ticket) -> WorkerRecord:
        try:
            with tracing.span("queue wait"):
                worker = await ticket.assignment.wait()
            # An assignment already made does not yield: a client gone by now
            # must not reach the worker (no task switch unless cancelled).
            await anyio.lowlevel.checkpoint_if_cancelled()
            return worker
        except anyio.get_cancelled_exc_class():
            self.scheduler.withdraw(ticket, self.clock())
            raise

    async def first_token(self, ticket: Ticket, call: UpstreamCall) -> Attempt:
        """The winning attempt. Attempts (the primary, then any retries) run one
        after another in the caller's task: no channel, no message. A hedge, if
        the hedge delay passes before a first token, is the only task started."""
        first = await self.assigned_worker(ticket)
        race = _Race(ticket, call, [first.registration.worker_id])
        hedge_at = self._hedge_at(ticket, first)
        if hedge_at == math.inf:
            return await self._one_at_a_time(race, first)
        return await self._hedgeable(race, first, hedge_at)

    async def _one_at_a_time(self, race: _Race, worker: WorkerRecord) -> Attempt:
        kind: AttemptKind = "primary"
        while True:
            result = await self._try(race, worker, kind)
            if isinstance(result, Attempt):
                return result
            race.errors.append(result)
            if isinstance(result, UpstreamRejected):
                break
            retry = await self._retry_worker(race)
            if retry is None:
                break
            worker, kind = retry, "retry"
        raise _final_error(race.errors)

    async def _hedgeable(self, race: _Race, first: WorkerRecord, hedge_at: float) -> Attempt:
        """As ``_one_at_a_time``, with a timer armed while an attempt runs: when it
        fires (the hedge delay passed, no first token), the hedge starts in a task
        of its own -- the only task a race ever adds. The first attempt to reach
        its first token wins; the other is cancelled, which closes its connection.
        A retry waits until a running hedge has failed."""
        loop = asyncio.get_running_loop()
        inline = anyio.CancelScope()
        hedge = _Hedge()
        try:
            async with anyio.create_task_group() as tg:

                def hedge_now() -> None:  # a loop callback: nothing may escape it
                    hedge.timer = None
                    if not race.hedged and race.winner is None and race.running:
                        try:
                            self._hedge(tg, race, hedge, inline)
                        except Exception:
                            log.exception("request %s: the hedge could not start; the "
                                          "primary goes on alone", race.ticket.request_id)

                worker = first
                kind: AttemptKind = "primary"
                with inline:
                    while True:
                        if not race.hedged:
                            hedge.timer = loop.call_at(hedge_at, hedge_now)
                        race.running += 1
                        try:
                            result = await self._try(race, worker, kind)
                        finally:
                            race.running -= 1
                            hedge.disarm()
                        if isinstance(result, Attempt):
                            if race.winner is None:
                                race.winner = result
                            else:  # the hedge won in the same instant
                                await self._close_losers([result], race.ticket.request_id)
                            break
                        race.errors.append(result)
                        if isinstance(result, UpstreamRejected):
                            break
                        if hedge.done is not None:  # a running hedge may still win
                            await hedge.done.wait()
                            if race.winner is not None or race.rejected:
                                break
                        retry = await self._retry_worker(race)
                        if retry is None:
                            break
                        worker, kind = retry, "retry"
                # Won, given up, or cancelled by a hedge that won or was refused:
                # a hedge still running has lost.
                hedge.disarm()
                tg.cancel_scope.cancel()
        except BaseException:  # the client left: even a winner must be closed now
            hedge.disarm()
            await self._close_losers(_present(race.winner), race.ticket.request_id)
            raise
        if race.winner is not None:
            return race.winner
        raise _final_error(race.errors)

    def _hedge(self, tg: TaskGroup, race: _Race, hedge: _Hedge, inline: anyio.CancelScope) -> None:
        race.hedged = True
        worker = self._reroute(race, hedge=True)
        if isinstance(worker, WorkerRecord):  # a hedge is never queued
            log.info("request %s: hedging on %s", race.ticket.request_id,
                     worker.registration.worker_id)
            race.tried.append(worker.registration.worker_id)
            hedge.done = anyio.Event()
            race.running += 1
            try:
                tg.start_soon(self._hedge_attempt, race, worker, hedge, inline)
            except BaseException:  # its slot was taken: give it back, and wait for nothing
                race.running -= 1
                race.tried.pop()
                hedge.done.set()
                self.report(worker.registration.worker_id, "abandoned")
                raise

    async def _hedge_attempt(self, race: _Race, worker: WorkerRecord, hedge: _Hedge,
                             inline: anyio.CancelScope) -> None:
        try:
            result = await self._try(race, worker, "hedge")
            if isinstance(result, Attempt):
                if race.winner is None:
                    race.winner = result
                    inline.cancel()  # the primary (or its retry) lost
                else:  # the primary won in the same instant
                    await self._close_losers([result], race.ticket.request_id)
            else:
                race.errors.append(result)
                if isinstance(result, UpstreamRejected):  # another worker would say the same
                    race.rejected = True
                    inline.cancel()
        finally:
            race.running -= 1
            assert hedge.done is not None
            hedge.done.set()

    async def _try(self, race: _Race, worker: WorkerRecord, kind: AttemptKind) -> AttemptResult:
        """One attempt up to its first token; an error it ended with is returned
        (and reported), cancellation is reported and raised."""
        worker_id = worker.registration.worker_id
        ttft_timeout = self._policy(race.ticket).timeouts.ttft_ms / 1000
        if race.ticket.upstream_at is None:
            race.ticket.upstream_at = time.monotonic()
        # Hedges and retries are siblings under the request's span; the worker's
        # own spans hang under this one (its traceparent).
        span = tracing.start_client_span("attempt", _attempt_attributes(race, worker, kind))
        try:
            attempt = await start_attempt(self.workers, worker, race.call,
                                          hedged=kind == "hedge",
                                          ttft_timeout_s=ttft_timeout, span=span)
        except UpstreamRejected as rejected:  # not retried: another worker would say the same
            log.log(logging.WARNING if rejected.worker_fault else logging.INFO,
                    "request %s: worker %s refused it: %s", race.ticket.request_id,
                    worker_id, rejected.detail)
            _attempt_ended(span, "rejected", rejected)
            # A 400 is the client's mistake, not the worker's; a 404 for a model
            # it registered is the worker's.
            self.report(worker_id, "failure" if rejected.worker_fault else "abandoned")
            return rejected
        except UpstreamFailed as failed:  # the detail is for operators only
            log.warning("request %s: worker %s failed: %s", race.ticket.request_id,
                        worker_id, failed.detail)
            _attempt_ended(span, "failed", failed)
            self.report(worker_id, "failure")
            return failed
        except BaseException:  # cancelled (lost the race, client left), or a bug
            _attempt_ended(span, "cancelled")
            self.report(worker_id, "abandoned")
            raise
        if span.is_recording():
            span.add_event("first_token", {"hedgerow.ttft_ms": round(attempt.ttft_s * 1000, 3)},
                           timestamp=tracing.wall_ns(attempt.first_token_at))
        self.scheduler.first_token(race.ticket.model, attempt.pool, attempt.ttft_s)
        return attempt

    def _hedge_at(self, ticket: Ticket, worker: WorkerRecord) -> float:
        if not (ticket.hedgeable and self._policy(ticket).hedging.enabled):
            return math.inf
        delay = self.scheduler.hedge_delay(ticket.model, worker.registration.kind)
        return math.inf if delay is None else anyio.current_time() + delay

    async def _retry_worker(self, race: _Race) -> WorkerRecord | None:
        """The worker for a retry (waiting in the queue when none is free); None
        when the policy allows no more retries, or none can be placed."""
        if race.retries >= self._policy(race.ticket).retries.before_first_token:
            return None
        placed = self._reroute(race, hedge=False)
        if placed is None:
            return None
        race.retries += 1
        worker = await self._requeued_worker(race) if isinstance(placed, Requeued) else placed
        if worker is not None:
            log.info("request %s: retrying on %s", race.ticket.request_id,
                     worker.registration.worker_id)
            race.tried.append(worker.registration.worker_id)
        return worker

    def _reroute(self, race: _Race, *, hedge: bool) -> WorkerRecord | Requeued | None:
        # No await between the answer and its use: a slot taken, or a ticket queued,
        # is always launched (and abandoned if cancelled) or its wait withdrawn.
        return self.scheduler.reroute(race.ticket, tuple(race.tried), hedge, self.clock())

    async def _requeued_worker(self, race: _Race) -> WorkerRecord | None:
        """Wait in the queue for the retry's worker; None when the queue sheds it."""
        log.info("request %s: no free worker for a retry, queued", race.ticket.request_id)
        try:
            return await self.assigned_worker(race.ticket)
        except NoHealthyWorker as shed:  # deadline_exceeded: the client gets the queue's 503
            race.errors.append(shed)
            return None

    async def _close_losers(self, leftovers: list[AttemptResult], request_id: str) -> None:
        for result in leftovers:
            if isinstance(result, Attempt):
                result.span.set_attribute("hedgerow.attempt.outcome", "lost")
                with anyio.CancelScope(shield=True):
                    await close_attempt(result, self, "abandoned", request_id)


async def close_attempt(attempt: Attempt, dispatcher: Dispatcher, outcome: Outcome,
                        request_id: str) -> None:
    """Close ``attempt``'s stream, then report it: the report (its worker slot freed)
    happens even when closing fails, which is logged, not raised; cancellation is."""
    try:
        await attempt.aclose()  # ends its span
    except Exception as error:
        log.warning("request %s: closing the stream from worker %s failed: %s: %s",
                    request_id, attempt.worker_id, type(error).__name__, error)
    finally:
        dispatcher.report(attempt.worker_id, outcome)


def _attempt_attributes(race: _Race, worker: WorkerRecord,
                        kind: AttemptKind) -> dict[str, AttributeValue] | None:
    if not tracing.enabled():  # nothing built for a span that is not recorded
        return None
    registration = worker.registration
    return {"hedgerow.worker.id": registration.worker_id, "hedgerow.worker.kind": registration.kind,
            "hedgerow.attempt.kind": kind, "hedgerow.attempt.index": len(race.tried) - 1,
            "hedgerow.worker.external": registration.external,
            tracing.GEN_AI_REQUEST_MODEL: race.call.model}


def _attempt_ended(span: Any, outcome: str, error: BaseException | None = None) -> None:
    """An attempt that ended before its first token: say how, and end its span."""
    span.set_attribute("hedgerow.attempt.outcome", outcome)
    if error is not None:
        tracing.failed(span, error)
    span.end()


def _present(attempt: Attempt | None) -> list[AttemptResult]:
    return [] if attempt is None else [attempt]


def _final_error(errors: list[HedgerowError]) -> HedgerowError:
    for error in errors:
        if isinstance(error, UpstreamRejected):
            return error
    if errors and isinstance(errors[-1], NoHealthyWorker):  # shed while queued for a retry
        return errors[-1]
    # Public messages only: an UpstreamFailed's names no worker and no address.
    detail = errors[-1].message if errors else "no worker could be reached"
    return NoHealthyWorker(f"no worker could serve the request: {detail}", retry_after=1)
