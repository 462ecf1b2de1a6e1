"""The gateway's drain: wait for what runs, cut the rest at the deadline."""

from __future__ import annotations

import anyio
import pytest

from gateway.drain import Drain, InFlight
from hedgerow.asgi import Message


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
