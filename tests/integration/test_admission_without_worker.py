"""Answers that need no worker still count against a tenant's requests/s.

Through the real gateway app (scheduler, dispatcher, in-process cache) over a
fake worker, tenant ``t`` is limited to 1 request/s with a burst of 3. Before
this, cache hits and single-flight joins were never admitted at all, so a
tenant could send any number of requests a second as long as they were
identical: the answer was free, and so was every connection and replay.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import pytest

from gateway.app import GatewayApp
from gateway.cache import ResponseCache
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from tests.integration.test_dispatch import make_policy, running
from tests.integration.test_resumable_streams import TOKENS, until
from tests.support.asgi_client import Gateway
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio

BURST = 3
LIMITED = [{"name": "t", "class": "interactive",
            "limits": {"requests_per_s": 1, "requests_burst": BURST}}]
REQUEST = orjson.dumps({"model": "m", "stream": True, "max_tokens": 16, "temperature": 0,
                        "messages": [{"role": "user", "content": "Count."}]})


@asynccontextmanager
async def limited_gateway(behaviour: Behaviour) -> AsyncIterator[Gateway]:
    policy = make_policy(tenants=LIMITED, hedging={"enabled": False},
                         cache={"enabled": True, "semantic": {"enabled": False}})
    async with running(policy, {"a": behaviour}) as rig:
        cache = ResponseCache(policy)
        app = GatewayApp(policy, LatestValue(RegistrySnapshot(version=0)), rig.scheduler,
                         rig.dispatcher, cache=cache)
        async with anyio.create_task_group() as tg:
            await tg.start(cache.run)
            yield Gateway(app, rig.workers, tg)
            tg.cancel_scope.cancel()


def _error(client: Any) -> dict[str, Any]:
    return client.json()["error"]  # type: ignore[no-any-return]


async def test_cache_hits_count_against_the_requests_rate() -> None:
    async with limited_gateway(Behaviour(tokens=TOKENS)) as gw:
        clients = []
        for _ in range(BURST + 1):  # one miss, then hits, all within the burst's second
            client = await gw.stream(request=REQUEST)
            await until(client.finished.is_set)
            clients.append(client)
        stats = gw.app.scheduler.stats()
    assert [c.header("x-hedgerow-cache") for c in clients[:BURST]] == ["miss"] + [
        "exact"] * (BURST - 1)
    assert [c.status for c in clients] == [200] * BURST + [429]
    assert _error(clients[-1])["code"] == "requests_rate"
    assert clients[-1].header("retry-after") is not None
    assert len(gw.workers.calls) == 1  # the refused one was not generated either
    assert stats["counters"]["requests_charged_at_door"] == BURST
    assert stats["counters"]["shed_requests_rate"] == 1


async def test_single_flight_joins_count_against_the_requests_rate() -> None:
    hold = anyio.Event()
    async with limited_gateway(Behaviour(tokens=TOKENS, token_gap_s=0.01, hold=hold)) as gw:
        clients = [await gw.stream(request=REQUEST) for _ in range(BURST + 2)]
        await until(lambda: len(gw.workers.calls) >= 1)
        await until(lambda: sum(c.finished.is_set() for c in clients) >= 2)  # the refused
        hold.set()
        await until(lambda: all(c.finished.is_set() for c in clients))
    statuses = sorted(c.status for c in clients)
    assert statuses == [200] * BURST + [429] * 2  # one leads, two join, two refused
    assert len(gw.workers.calls) == 1
    assert all(_error(c)["code"] == "requests_rate" for c in clients if c.status == 429)
