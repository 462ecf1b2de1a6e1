"""One streamed generation, written into its ``StreamLog`` instead of to a client.

The generation is admitted by the scheduler, gets its first token from the
dispatcher (retries and hedges included), then appends each worker event to
the log, classified (token, usage, done, error). Clients follow the log (see
``gateway.corridor.relay.follow_log``), so the generation neither waits for a slow
reader nor dies with a client whose connection dropped: it runs on while
someone reads it or may come back (``StreamLog.abandoned``).

Whatever ends it, the log ends with a terminal event — ``[DONE]`` or an SSE
error event — and is marked finished; the ticket is released and the worker's
outcome reported, shielded from cancellation, even when closing the worker's
stream fails (that is logged with the request id).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import anyio

from gateway.corridor.attempt import Attempt, UpstreamCall, upstream_chunk
from gateway.corridor.dispatch import Dispatcher, close_attempt
from gateway.corridor.relay import RelayOutcome, observe_chunk
from gateway.corridor.stream_log import EventKind, StreamLog
from gateway.corridor.scheduling import SchedulerDoor
from gateway.corridor.tickets import Outcome, Ticket
from hedgerow import openai_api as oa
from hedgerow import tracing
from hedgerow.asgi import sse_event
from hedgerow.errors import UpstreamFailed
from hedgerow.sse import SseEvent
from policies.admission import Refused

log = logging.getLogger("hedgerow.gateway.generation")


class DispatchObserver(Protocol):
    """Told when the first-token phase ended (the request's metrics)."""

    def dispatched(self, submitted: float, assigned: float | None,
                   upstream: float | None) -> None: ...


@dataclass
class Generation:
    scheduler: SchedulerDoor
    dispatcher: Dispatcher
    stream: StreamLog
    ticket: Ticket
    call: UpstreamCall
    keep_text: bool = False  # the response cache needs the text
    refused: Refused | None = None  # admission's answer, when it said no

    async def run(self, observer: DispatchObserver | None = None) -> RelayOutcome:
        """Generate into the log; the outcome says how it ended and the usage."""
        outcome = RelayOutcome(keep_text=self.keep_text)
        attempt: Attempt | None = None
        admitted = False
        try:
            with tracing.span("admission") as span:
                decision = await self.scheduler.submit(self.ticket)
                if isinstance(decision, Refused):
                    tracing.failed(span, decision.to_error())
                    self.refused = decision
                    self.stream.refuse(decision.to_error())
                    return outcome
            admitted = True
            try:
                attempt = await self.dispatcher.first_token(self.ticket, self.call)
            except Exception as error:  # before the first token: an HTTP error
                self.stream.refuse(error)
                return outcome
            finally:
                if observer is not None:
                    t = self.ticket
                    observer.dispatched(t.arrival, t.assigned_at, t.upstream_at)
            if tracing.enabled():
                tracing.current().add_event("first_token", {
                    "hedgerow.worker.id": attempt.worker_id, "hedgerow.hedged": attempt.hedged},
                    timestamp=tracing.wall_ns(attempt.first_token_at))
            self.stream.open(attempt.worker_id, attempt.hedged)
            with tracing.span("relay", _worker(attempt)) as span:
                await self._relay(attempt, outcome)
                if span.is_recording():
                    span.set_attributes({tracing.GEN_AI_OUTPUT_TOKENS: outcome.completion_tokens,
                                         "hedgerow.relay.complete": outcome.complete})
                    if outcome.failed:
                        tracing.failed(span, outcome.error_code or "upstream_failed")
            return outcome
        finally:
            with anyio.CancelScope(shield=True):
                await self._end(attempt, outcome, admitted)

    async def _relay(self, attempt: Attempt, outcome: RelayOutcome) -> None:
        try:
            for event in attempt.first:
                self._append(event, outcome, attempt.first_token_at)
            async for event in attempt.events:
                self._append(event, outcome, time.monotonic())
            if not outcome.complete:
                raise UpstreamFailed("ended the stream before it was complete",
                                     code="upstream_truncated")
        except UpstreamFailed as error:  # the client reads the public message only
            log.warning("request %s: stream from worker %s failed mid-way: %s",
                        self.ticket.request_id, attempt.worker_id, error.detail)
            self._fail(outcome, error.message, error.code)

    def _append(self, event: SseEvent, outcome: RelayOutcome, received: float) -> None:
        self.stream.append(classify(event, outcome), event.raw, received)

    def _fail(self, outcome: RelayOutcome, message: str, code: str) -> None:
        outcome.failed = True
        outcome.error_message, outcome.error_code = message, code
        self._append_error(message, code)

    def _append_error(self, message: str, code: str,
                      error_type: str = UpstreamFailed.error_type) -> None:
        payload = sse_event(oa.error_event(message, error_type, code))
        self.stream.append("error", payload, time.monotonic())

    async def _end(self, attempt: Attempt | None, outcome: RelayOutcome, admitted: bool) -> None:
        # Each release happens whatever the one before it raised: a worker slot
        # or a tenant's concurrency not given back is held until a restart.
        try:
            stream = self.stream
            if stream.started and not stream.finished and not (outcome.complete
                                                               or outcome.failed):
                reason = stream.cancel_reason or "the generation stopped: no client was reading it"
                self._append_error(reason, stream.cancel_code, stream.cancel_type)
            stream.finish(time.monotonic())
        finally:
            try:
                if attempt is not None:
                    result: Outcome = ("failure" if outcome.failed else
                                       "success" if outcome.complete else "abandoned")
                    attempt.span.set_attribute("hedgerow.attempt.outcome", result)
                    await close_attempt(attempt, self.dispatcher, result, self.stream.request_id)
            finally:
                if admitted:
                    await self.scheduler.ticket_done(self.ticket, outcome.total_tokens)


def _worker(attempt: Attempt) -> dict[str, tracing.AttributeValue] | None:
    return {"hedgerow.worker.id": attempt.worker_id} if tracing.enabled() else None


def classify(event: SseEvent, outcome: RelayOutcome) -> EventKind:
    """What one worker event is, noting usage, text and the end in ``outcome``;
    UpstreamFailed for an error event or one that is no completion chunk
    (``gateway.corridor.attempt.upstream_chunk``): the gateway writes its own error event."""
    chunk = upstream_chunk(event)
    if chunk is None:
        outcome.complete = True
        return "done"
    pieces = outcome.pieces
    if observe_chunk(outcome, chunk):
        return "usage"
    return "token" if outcome.pieces > pieces else "other"
