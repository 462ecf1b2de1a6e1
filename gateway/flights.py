"""A generation writes a log; clients follow it (the request corridor's core).

A miss leads a ``Flight``: its generation runs in one task beside the client's
reader (this request's own task), and identical requests arriving meanwhile
join it as readers of the same ``StreamLog``. No task watches for
abandonment: the log moves the generation's deadline as readers come and go
(``StreamLog.stop_when_abandoned``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio

from gateway.app_state import AppState
from gateway.cache.entry import entry_from_fold
from gateway.corridor.drain import InFlight
from gateway.corridor.generation import Generation
from gateway.corridor.beside import join
from gateway.admin.metrics import RequestMetrics
from gateway.corridor.relay import ClientStalled, RelayOutcome, completion_body, follow_log
from gateway.request_terms import (
    Caching,
    Flight,
    JOIN_USAGE_WAIT_S,
    Wanted,
    answer_headers,
    end_with_draining,
    note_usage,
)
from gateway.corridor.stream_log import StreamLog
from hedgerow import openai_api as oa
from hedgerow.asgi import Request, SSE_HEADERS, cancel_on_disconnect, send_bytes
from hedgerow.errors import UpstreamFailed

log = logging.getLogger("hedgerow.gateway")

GENERATION_TASK = "hedgerow.generation"  # the name of each streamed miss's one extra task


class Flights(AppState):
    """A generation writes a log; clients follow it."""

    async def _lead(self, request: Request, wanted: Wanted, caching: Caching | None,
                    in_flight: InFlight) -> bool:
        """Generate the answer, sharing it with identical requests that arrive
        meanwhile and storing it in the cache; False when the client left first.

        The generation runs beside the client's reader. When a streaming
        client goes away it runs on for the policy's resume grace, so the
        client can come back with ``Last-Event-ID``; a client that leaves
        before the first token (it never learnt the stream's id) stops it at
        once, unless others share it.
        """
        ticket, parsed = wanted.ticket, wanted.parsed
        settings = (ticket.policy or self.policy).streams
        stream = StreamLog(ticket.request_id, ticket.tenant, settings.max_buffer_bytes,
                           include_usage=parsed.include_usage())
        flight = Flight(stream)
        end_with_draining(stream, in_flight)
        if parsed.stream:
            self.streams.add(stream, time.monotonic())
        if caching is not None and caching.share:
            self._flights[caching.key] = flight
        generation = Generation(self.scheduler, self.dispatcher, stream, ticket, wanted.call,
                                keep_text=caching is not None or not parsed.stream)
        generating = anyio.CancelScope()
        grace_s = settings.resume_grace_ms / 1000 if parsed.stream else 0.0

        async def generate() -> None:
            try:
                with generating:
                    flight.outcome = await generation.run(wanted.observed)
                note_usage(wanted.observed, flight.outcome)
            finally:
                flight.done.set()
                if caching is not None and self._flights.get(caching.key) is flight:
                    del self._flights[caching.key]
            if caching is not None:
                await self._cache_store(caching, wanted, flight.outcome)

        completed = False
        error: Exception | None = None
        # The generation's task beside this one (the client's reader, whose
        # disconnect is a server callback, not a task); the primary attempt runs
        # in the generation's. No task watches for abandonment: the log moves the
        # generation's deadline as readers come and go. A plain task, not a task
        # group (a quarter of the cost): ``join`` gives it the group's
        # guarantees (``gateway.corridor.beside``).
        generation_task = asyncio.get_running_loop().create_task(generate(), name=GENERATION_TASK)
        try:
            with stream.reading():
                stream.stop_when_abandoned(generating, grace_s)
                try:
                    completed = await cancel_on_disconnect(
                        request, lambda: self._answer(request, wanted, flight))
                except Exception as caught:  # re-raised as itself, once the generation ended
                    error = caught
        except BaseException:  # this request is being cancelled: its generation too
            generating.cancel()
            raise
        finally:
            await join(generation_task, generating)
        if error is not None:
            raise error
        return completed

    async def _cache_store(self, caching: Caching, wanted: Wanted,
                           outcome: RelayOutcome | None) -> None:
        if self.cache is None or outcome is None or outcome.failed or not outcome.complete:
            return
        ticket = wanted.ticket
        entry = entry_from_fold(outcome.fold, outcome.finish_reason, outcome.prompt_tokens,
                                outcome.completion_tokens, ticket.model, oa.now_created())
        if entry is None:  # an answer the cache could not give back exactly
            return
        with anyio.CancelScope(shield=True):
            await self.cache.store(ticket.tenant, ticket.model, caching.request_json, entry,
                                   caching.headers, keys=caching.keys)

    async def _join(self, request: Request, wanted: Wanted, flight: Flight) -> bool:
        """An identical request is being generated: follow it instead of generating again."""
        self.metrics.single_flight_joined()
        if wanted.parsed.stream:
            self.streams.alias(wanted.ticket.request_id, wanted.ticket.tenant, flight.stream,
                               time.monotonic())
        with flight.stream.reading():
            answered = await cancel_on_disconnect(
                request, lambda: self._answer(request, wanted, flight))
        # The leader's usage, once its generation has ended (it ends with the stream).
        with anyio.move_on_after(JOIN_USAGE_WAIT_S):
            await flight.done.wait()
        note_usage(wanted.observed, flight.outcome, cached="joined")
        return answered

    async def _answer(self, request: Request, wanted: Wanted, flight: Flight) -> None:
        if wanted.parsed.stream:
            await self._answer_stream(request, flight.stream, 0, wanted.observed,
                                      include_usage=wanted.parsed.include_usage(),
                                      request_id=wanted.ticket.request_id)
        else:
            await self._answer_whole(request, wanted, flight)

    async def _answer_stream(self, request: Request, stream: StreamLog, after: int,
                             observed: RequestMetrics | None, *, cache: bytes = b"miss",
                             include_usage: bool | None = None,
                             request_id: str | None = None) -> None:
        """Start the SSE response once the stream has its first token, then follow it."""
        await stream.wait_open()
        request_id = request_id or stream.request_id
        if stream.refusal is not None:
            raise stream.refusal.error
        if not stream.started:
            raise UpstreamFailed("the generation stopped before its first token",
                                 code="stream_cancelled")
        if observed is not None:
            observed.responded(200)
            observed.served_by(stream.worker_id, stream.hedged)
            if stream.hedged and request_id == stream.request_id:
                self.metrics.hedge_won()
        headers = answer_headers(request_id, stream.worker_id, cache, stream.hedged)
        await request.send({"type": "http.response.start", "status": 200,
                            "headers": list(SSE_HEADERS) + headers})
        settings = self.policy.streams
        try:
            await follow_log(request, stream, after=after,
                             include_usage=(stream.include_usage if include_usage is None
                                            else include_usage),
                             heartbeat_s=settings.heartbeat_ms / 1000,
                             stall_s=settings.write_stall_ms / 1000, observer=observed)
        except ClientStalled as stalled:
            log.warning("cut a stalled client of %s: %s", stream.request_id, stalled)

    async def _answer_whole(self, request: Request, wanted: Wanted, flight: Flight) -> None:
        """A non-streaming client: the generation folded into one JSON body."""
        await flight.done.wait()
        stream, outcome, ticket = flight.stream, flight.outcome, wanted.ticket
        if stream.refusal is not None:
            raise stream.refusal.error
        if outcome is None or outcome.failed or not outcome.complete:
            # The generation logged the worker's detail; the client gets the public message.
            raise UpstreamFailed("the generation failed after its first token",
                                 code=(outcome.error_code if outcome else "") or "upstream_error")
        if stream.hedged and ticket.request_id == stream.request_id:
            self.metrics.hedge_won()
        body = completion_body(ticket.request_id, ticket.model, outcome, wanted.chat)
        wanted.observed.responded(200)
        wanted.observed.served_by(stream.worker_id, stream.hedged)
        await send_bytes(request.send, 200, body, answer_headers(
            ticket.request_id, stream.worker_id, b"miss", stream.hedged))
