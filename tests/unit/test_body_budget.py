"""One budget for the request bodies being read at once (``hedgerow.body_budget``)."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgerow.asgi import Message, Request, Scope
from hedgerow.body_budget import BodyBudget
from hedgerow.errors import BodyBudgetExhausted, PayloadTooLarge


def test_reserve_and_release() -> None:
    budget = BodyBudget(100)
    assert budget.try_reserve(60) and budget.try_reserve(40)
    assert not budget.try_reserve(1)
    assert not budget.fits(1) and budget.fits(0)
    budget.release(60)
    assert budget.fits(60) and not budget.fits(61)
    assert budget.stats() == {"in_use": 40, "limit": 100, "peak": 100, "refused": 3}
    with pytest.raises(RuntimeError):
        budget.release(41)
    with pytest.raises(ValueError):
        BodyBudget(0)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=100))
def test_in_use_never_passes_the_limit_and_returns_to_zero(steps: list[tuple[bool, int]]) -> None:
    budget = BodyBudget(120)
    held: list[int] = []
    for reserve, size in steps:
        if reserve or not held:
            if budget.try_reserve(size):
                held.append(size)
        else:
            budget.release(held.pop())
        assert 0 <= budget.in_use == sum(held) <= budget.limit_bytes
    for size in held:
        budget.release(size)
    assert budget.in_use == 0


# -- through Request.body -------------------------------------------------------

pytestmark_anyio = pytest.mark.anyio


def _request(chunks: list[bytes], *, declared: int | None = None, hold: anyio.Event | None = None,
             ) -> tuple[Request, list[Message]]:
    """A request whose body comes as ``chunks``; with ``hold``, the last chunk waits for it."""
    pending = list(chunks)

    async def receive() -> Message:
        if len(pending) == 1 and hold is not None:
            await hold.wait()
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope: Scope = {"type": "http", "method": "POST", "path": "/", "headers": headers,
                    "http_version": "2"}
    return Request(scope, receive, send), sent


@pytestmark_anyio
async def test_bodies_being_read_hold_the_budget_and_a_new_one_is_refused_at_once() -> None:
    budget = BodyBudget(1000)
    hold = anyio.Event()
    read: list[bytes] = []

    async def slow(index: int) -> None:
        request, _ = _request([b"x" * 400, b"y"], hold=hold)
        read.append(await request.body(10_000, budget=budget))

    async with anyio.create_task_group() as tg:
        for index in range(2):
            tg.start_soon(slow, index)
        await anyio.wait_all_tasks_blocked()
        assert budget.in_use == 800  # two bodies half-read
        # Declared and too big for what is free: refused before any of it is read.
        started = anyio.current_time()
        declared, _ = _request([b"z" * 300], declared=300)
        with pytest.raises(BodyBudgetExhausted) as refused:
            await declared.body(10_000, budget=budget)
        assert refused.value.status == 503 and refused.value.retry_after == 1
        assert declared.body_done
        # Undeclared (chunked): refused at the chunk that does not fit.
        chunked, _ = _request([b"a" * 150, b"b" * 100])
        with pytest.raises(BodyBudgetExhausted):
            await chunked.body(10_000, budget=budget)
        assert anyio.current_time() - started < 0.5  # at once, not after waiting
        assert budget.in_use == 800  # the refused ones gave back what they took
        hold.set()
    assert read == [b"x" * 400 + b"y"] * 2
    assert budget.in_use == 0  # read: given back
    small, _ = _request([b"{}"], declared=2)
    assert await small.body(10_000, budget=budget) == b"{}"
    assert budget.stats()["refused"] == 2 and budget.stats()["peak"] == 950  # the chunked one got 150 in


@pytestmark_anyio
async def test_a_body_over_its_own_limit_is_still_413_and_gives_back_its_bytes() -> None:
    budget = BodyBudget(1000)
    request, _ = _request([b"x" * 60, b"x" * 60])
    with pytest.raises(PayloadTooLarge):
        await request.body(100, budget=budget)
    assert budget.in_use == 0
