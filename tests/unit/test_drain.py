"""The gateway's drain: wait for what runs, cut the rest at the deadline."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import orjson
import pytest
from anyio import wait_all_tasks_blocked

from gateway.app import end_with_draining
from gateway.corridor.attempt import UpstreamCall
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.drain import Drain, InFlight
from gateway.corridor.generation import Generation
from gateway.corridor.stream_log import StreamLog
from gateway.corridor.scheduling import SchedulerDoor
from gateway.corridor.tickets import QUEUED, Queued, Ticket
from hedgerow.asgi import Message
from hedgerow.sse import SseEvent
from hedgerow.tracing import NO_SPAN


@pytest.mark.anyio
async def test_drain_returns_as_soon_as_the_last_request_finishes() -> None:
    drain = Drain()

    async def request(duration: float) -> None:
        with drain.track():
            await anyio.sleep(duration)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, 0.05)
        tg.start_soon(request, 0.1)
        await anyio.sleep(0.01)
        drain.begin()
        started = anyio.current_time()
        await drain.cut_after(5.0)
        assert anyio.current_time() - started < 1.0
    assert drain.in_flight == 0


@pytest.mark.anyio
async def test_requests_still_running_at_the_deadline_are_cut() -> None:
    drain = Drain()
    cut: list[InFlight] = []

    async def request() -> None:
        with drain.track() as in_flight:
            await anyio.sleep(10)
        cut.append(in_flight)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await anyio.sleep(0.01)
        drain.begin()
        await drain.cut_after(0.05)
    assert [c.cut for c in cut] == [True]
    # A request arriving after the deadline is cut at once.
    with drain.track() as late:
        await anyio.sleep(10)
    assert late.cut


@pytest.mark.anyio
async def test_in_flight_notes_how_far_the_response_got() -> None:
    in_flight = InFlight()
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    watched = in_flight.watch(send)
    await watched({"type": "http.response.start", "status": 200, "headers": []})
    assert in_flight.response_started and not in_flight.response_finished
    await watched({"type": "http.response.body", "body": b"x", "more_body": True})
    assert not in_flight.response_finished
    await watched({"type": "http.response.body", "body": b""})
    assert in_flight.response_finished and len(sent) == 3


@pytest.mark.anyio
async def test_the_cut_tells_every_request_before_it_cancels_any() -> None:
    drain = Drain()
    seen: list[tuple[str, bool]] = []
    requests: dict[str, InFlight] = {}

    async def request(name: str, other: str) -> None:
        with drain.track() as in_flight:
            requests[name] = in_flight
            in_flight.before_cut.append(
                lambda: seen.append((name, requests[other].scope.cancel_called)))
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(request, "a", "b")
        tg.start_soon(request, "b", "a")
        await wait_all_tasks_blocked()
        drain.cut()
    assert sorted(seen) == [("a", False), ("b", False)]
    assert all(r.cut for r in requests.values())


TOKEN = orjson.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}}]}).decode()


class _Admits:
    """The scheduler's side of a generation: every ticket admitted (queued)."""

    async def submit(self, ticket: object) -> Queued:
        return QUEUED

    async def ticket_done(self, ticket: object, actual_tokens: int) -> None:
        pass


@dataclass
class _Attempt:
    """A worker stream that sent one token and then nothing: the drain must cut it."""

    worker_id: str = "w1"
    hedged: bool = False
    first_token_at: float = 0.0
    span: Any = NO_SPAN  # as ``gateway.corridor.attempt.Attempt``: tracing off
    first: list[SseEvent] = field(default_factory=lambda: [SseEvent(
        data=TOKEN, raw=b"data: " + TOKEN.encode() + b"\n\n")])

    @property
    def events(self) -> AsyncIterator[SseEvent]:
        return self._silent()

    async def _silent(self) -> AsyncIterator[SseEvent]:
        await anyio.sleep_forever()
        yield SseEvent(data="[DONE]")

    async def aclose(self) -> None:
        pass


class _OneWorker:
    async def first_token(self, ticket: object, call: object) -> _Attempt:
        return _Attempt()

    def report(self, worker_id: str, result: str) -> None:
        pass


@pytest.mark.anyio
async def test_a_generation_ending_first_at_the_cut_still_ends_with_gateway_draining() -> None:
    """The race in the drain: the cut cancels the request's scope, and the
    generation may end first and write the stream's last event before
    ``_end_cut_request`` runs (which then sees the response done). That event
    must be gateway_draining, not stream_cancelled. Here the generation is the
    only writer, so it always ends first: no timing is involved."""
    drain = Drain()
    stream = StreamLog("r1", "tenant", 1 << 20)
    generation = Generation(cast(SchedulerDoor, _Admits()), cast(Dispatcher, _OneWorker()), stream,
                            cast(Ticket, None), cast(UpstreamCall, None))
    cut: list[InFlight] = []

    async def request() -> None:
        with drain.track() as in_flight:
            end_with_draining(stream, in_flight)
            await generation.run()
        cut.append(in_flight)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await stream.wait_open()
        await wait_all_tasks_blocked()  # the generation waits on its silent worker
        drain.cut()
    assert [c.cut for c in cut] == [True]
    kinds = [event.kind for event in stream.events_after(0)]
    assert kinds == ["token", "error"] and stream.finished
    last = stream.events_after(0)[-1].payload.decode()
    error = orjson.loads(last.split("data: ", 1)[1])["error"]
    assert (error["code"], error["type"]) == ("gateway_draining", "service_unavailable")


@pytest.mark.anyio
async def test_a_stream_the_client_cancelled_keeps_its_own_ending_at_the_cut() -> None:
    stream = StreamLog("r1", "tenant", 1 << 20)
    stream.cancel("the stream was cancelled by the client")
    drain = Drain()
    with drain.track() as in_flight:
        end_with_draining(stream, in_flight)
        drain.cut()
    assert (stream.cancel_reason, stream.cancel_code) == (
        "the stream was cancelled by the client", "stream_cancelled")
