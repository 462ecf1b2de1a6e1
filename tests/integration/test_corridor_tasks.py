"""What one streamed request costs in tasks, through the real gateway app.

Every task the event loop creates while a request runs is counted (a task
factory that records each coroutine's name), with the app called as an ASGI
app by an in-memory client (its own task: the server's task for the request)
over the fake workers of ``tests.support.fake_workers``. The client offers
the ``hedgerow.disconnect`` extension, as the gateway's hypercorn does
(``hedgerow.http_stack.disconnect_hook``). A plain streamed miss runs in its
own task (the server's) plus one Hedgerow task, the generation; a retry runs
where the primary did; a hedge adds one task, the hedge's attempt, and only
when it starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import pytest

from gateway.app import GatewayApp
from gateway.flights import GENERATION_TASK
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from tests.integration.test_dispatch import make_policy, running
from tests.support.asgi_client import Client, Gateway, body
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio

TOKENS = tuple(f" t{i}" for i in range(64))


@contextmanager
def counting_tasks() -> Iterator[list[str]]:
    """The names of every task created meanwhile (anyio names a task after its
    function), filled in when the block ends."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[Any]] = []
    names: list[str] = []
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = (asyncio.Task(coro, loop=loop, **kwargs) if previous is None
                else previous(loop, coro, **kwargs))
        tasks.append(task)  # type: ignore[arg-type]
        return task  # type: ignore[return-value]

    loop.set_task_factory(factory)  # type: ignore[arg-type]
    try:
        yield names
    finally:
        loop.set_task_factory(previous)
        names.extend(task.get_name() for task in tasks)


@asynccontextmanager
async def gateway(behaviours: dict[str, Behaviour], **policy: Any) -> AsyncIterator[Gateway]:
    settings = make_policy(cache={"enabled": False}, **policy)
    async with running(settings, behaviours) as rig:
        app = GatewayApp(settings, LatestValue(RegistrySnapshot(version=0)), rig.scheduler,
                         rig.dispatcher)
        async with anyio.create_task_group() as tg:
            yield Gateway(app, rig.workers, tg)
            tg.cancel_scope.cancel()


async def streamed(gw: Gateway) -> tuple[Client, list[str]]:
    """One streamed request, served to its end; the tasks created meanwhile."""
    with counting_tasks() as made:
        client = await gw.stream()
        with anyio.fail_after(5):
            await client.finished.wait()
    assert client.status == 200 and client.text() == "".join(TOKENS)
    return client, made


GENERATE = GENERATION_TASK
HEDGE = "gateway.corridor.dispatch.Dispatcher._hedge_attempt"


@pytest.mark.parametrize("hedging", [False, True], ids=["hedging-off", "hedging-on"])
async def test_a_plain_streamed_miss_runs_in_its_own_task_plus_one(hedging: bool) -> None:
    async with gateway({"a": Behaviour(tokens=TOKENS)}, hedging={"enabled": hedging}) as gw:
        await streamed(gw)  # warm: the pool's connection, lazily made state
        client, made = await streamed(gw)
    assert client.header("x-hedgerow-hedged") == "0"
    # The request's own task (the server's) and the generation beside its
    # reader: the primary attempt runs in the generation's task (a hedge timer
    # armed when hedging is on), nothing watches for abandonment, and the
    # server's callback, not a task, notices the client leaving.
    assert len(made) == 2, made
    assert made[1:] == [GENERATE], made


async def test_without_the_servers_hook_a_watcher_task_notices_the_client_leaving() -> None:
    async with gateway({"a": Behaviour(tokens=TOKENS)}, hedging={"enabled": False}) as gw:
        await streamed(gw)
        with counting_tasks() as made:
            client = gw.start(Client("POST", "/v1/chat/completions", body(),
                                     headers=[(b"content-type", b"application/json")],
                                     disconnect_hook=False))
            with anyio.fail_after(5):
                await client.finished.wait()
    assert client.status == 200 and client.text() == "".join(TOKENS)
    assert sorted(made[1:]) == sorted([GENERATE,
                                       "hedgerow.asgi.cancel_on_disconnect.<locals>.watch"]), made


async def test_a_streamed_miss_that_fails_over_retries_in_the_same_task() -> None:
    behaviours = {"a": Behaviour(tokens=TOKENS, status=503), "b": Behaviour(tokens=TOKENS)}
    async with gateway(behaviours, hedging={"enabled": False},
                       retries={"before_first_token": 2}) as gw:
        await streamed(gw)
        client, made = await streamed(gw)
    assert len(made) == 2, made  # the retry ran where the failed primary did
    assert len(gw.workers.calls) == 4 or client.header("x-hedgerow-worker") == "b"


async def test_a_hedged_streamed_miss_opens_its_race_only_for_the_hedge() -> None:
    slow = Behaviour(tokens=TOKENS, headers_after_s=1.0)
    async with gateway({"a": slow, "b": Behaviour(tokens=TOKENS)},
                       hedging={"floor_ms": 50, "ceiling_ms": 50}) as gw:
        # Route the primary to the slow worker: take b's slots while it is chosen.
        client, made = await hedged_once(gw)
    assert client.header("x-hedgerow-hedged") == "1", made
    # The plain request's two, and the hedge's attempt: the primary stayed in
    # the generation's task.
    assert len(made) == 3, made
    assert sorted(made[1:]) == sorted([GENERATE, HEDGE]), made


async def hedged_once(gw: Gateway) -> tuple[Client, list[str]]:
    for _ in range(8):  # the scheduler picks a worker; retry until the slow one was first
        client, made = await streamed(gw)
        if client.header("x-hedgerow-hedged") == "1":
            return client, made
    raise AssertionError("no request was hedged")
