"""``gateway.corridor.beside.join``: a plain task given a task group's guarantees."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from gateway.corridor.beside import join

pytestmark = pytest.mark.anyio


def failing(work: anyio.CancelScope, after_s: float, error: Exception) -> asyncio.Task[None]:
    """A generation that runs in ``work`` for ``after_s`` (or until it is
    cancelled), then fails with ``error``."""

    async def generation() -> None:
        with work:
            await anyio.sleep(after_s)
        raise error

    return asyncio.get_running_loop().create_task(generation())


async def test_the_request_waits_for_its_task_and_gets_its_error() -> None:
    work = anyio.CancelScope()
    task = failing(work, 0.01, ValueError("the generation broke"))
    with pytest.raises(ValueError, match="the generation broke"):
        await join(task, work)
    assert task.done()


async def test_a_cancelled_request_cancels_the_work_waits_for_its_cleanup_then_is_cancelled() -> None:
    work = anyio.CancelScope()
    steps: list[str] = []

    async def generation() -> None:
        try:
            with work:
                await anyio.sleep(30)
            steps.append("work cancelled")
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.05)  # cleanup that awaits (closing the upstream)
                steps.append("cleanup done")

    task = asyncio.get_running_loop().create_task(generation())
    with anyio.CancelScope() as request:
        request.cancel()  # the drain's cut, say
        await join(task, work)
        steps.append("request went on")  # never: the cancellation is re-raised
    assert request.cancelled_caught
    assert steps == ["work cancelled", "cleanup done"]
    assert task.done() and not task.cancelled()


async def test_a_native_cancel_of_the_request_still_waits_for_the_task() -> None:
    work = anyio.CancelScope()
    ended = asyncio.Event()

    async def generation() -> None:
        try:
            with work:
                await anyio.sleep(30)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.05)
            ended.set()

    async def request() -> None:
        await join(asyncio.get_running_loop().create_task(generation()), work)

    outer = asyncio.get_running_loop().create_task(request())
    await anyio.sleep(0.01)
    outer.cancel()  # as a server tears down a request's task
    await anyio.sleep(0.01)
    outer.cancel()  # and again, while it waits out the cleanup
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert ended.is_set()


async def test_a_failure_while_the_request_is_cancelled_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    work = anyio.CancelScope()
    task = failing(work, 30, RuntimeError("broke while stopping"))
    with anyio.CancelScope() as request:
        request.cancel()
        await join(task, work)
    assert request.cancelled_caught
    assert "broke while stopping" in caplog.text
