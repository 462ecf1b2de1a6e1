"""The response cache shared through a real redis-server, and surviving its loss."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from gateway.cache import Hit, ResponseCache
from gateway.cache.entry import CacheEntry
from gateway.cache.semantic_cache import STREAM
from gateway.cache.store import PREFIX, ExactKey, RedisStore
from policies.loader import parse_policy_document
from tests.support.cache_fakes import WordsEmbedder
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

pytestmark = pytest.mark.anyio

POLICY = parse_policy_document("""
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants: [{name: a, class: interactive}, {name: b, class: interactive}]
models: [{name: m}, {name: n}]
cache:
  redis_timeout_ms: 100
  redis_retry_after_s: 0.2
  semantic: {enabled: true, pair_threshold: 0.8}  # the bag-of-words twin judges: its scale
""")
ANSWER = CacheEntry("About 3.1 miles.", "stop", 12, 5, "m", 1)


def chat(question: str, model: str = "m") -> dict[str, Any]:
    return {"model": model, "temperature": 0, "messages": [{"role": "user", "content": question}]}


@pytest.fixture
async def clean(redis_server: RedisServer) -> AsyncIterator[str]:
    client = Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    yield redis_server.url


@asynccontextmanager
async def gateway(url: str) -> AsyncIterator[ResponseCache]:
    """One gateway's cache, its follower running, as the gateway supervises it."""
    cache = ResponseCache(POLICY, url, embedder=WordsEmbedder())
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(cache.run)
            yield cache
            tg.cancel_scope.cancel()
    finally:
        await cache.aclose()


async def eventually(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    with anyio.fail_after(timeout):
        while True:
            result = await check()
            if result:
                return result
            await anyio.sleep(0.05)


async def test_an_answer_stored_by_one_gateway_is_an_exact_hit_on_another(clean: str) -> None:
    async with gateway(clean) as one, gateway(clean) as two:
        assert await one.store("a", None, chat("How far is 5 km in miles?"), ANSWER)
        hit = await two.lookup("a", None, chat("How far is 5 km in miles?"), {})
        assert hit == Hit("exact", ANSWER, hit.key if hit else "")
        # ...but never for another tenant.
        assert await two.lookup("b", None, chat("How far is 5 km in miles?"), {}) is None
        raw = Redis.from_url(clean)
        ttl = await raw.ttl(PREFIX + hit.key)  # type: ignore[union-attr]
        await raw.aclose()
        assert 0 < ttl <= POLICY.cache.exact.ttl_s


async def test_semantic_entries_reach_running_gateways_and_rebuild_new_ones(clean: str) -> None:
    async with gateway(clean) as one, gateway(clean) as two:
        await one.store("a", None, chat("how far is 5 km in miles"), ANSWER)

        async def two_has_it() -> Hit | None:
            return await two.lookup("a", None, chat("how far is 5 km in miles please"), {})

        hit = await eventually(two_has_it)
        assert hit.kind == "semantic" and hit.entry == ANSWER
        copied = await two.lookup("a", None, chat("how far is 5 km in miles"), {})
        assert copied is not None and copied.kind == "exact"
        assert two.stats()["exact_entries"] == 1  # now in two's memory too
        async with gateway(clean) as late:  # started after the entry was written
            assert late.semantic.synced >= 1
            rebuilt = await late.lookup("a", None, chat("how far is 5 km in miles please"), {})
            assert rebuilt is not None and rebuilt.kind == "semantic"
        # A purge on one gateway empties the others' semantic indexes too.
        await one.purge(tenant="a")

        async def two_lost_it() -> bool:
            semantic = await two.lookup("a", None, chat("how far is 5 km in miles please"), {})
            # two had copied the exact entry into its memory: the purge reaches that too
            exact = await two.lookup("a", None, chat("how far is 5 km in miles"), {})
            return semantic is None and exact is None

        assert await eventually(two_lost_it)


async def test_redis_purge_by_tenant_model_and_key(clean: str) -> None:
    redis = Redis.from_url(clean)
    store = RedisStore(redis, ttl_s=60)
    keys = [ExactKey("k1", "tenant:a", "m"), ExactKey("k2", "tenant:a", "n"),
            ExactKey("k3", "tenant:b", "m"), ExactKey("k4", "tenant:b", "n")]
    for key in keys:
        await store.put(key, ANSWER, 0)
    assert await store.purge(key="k4") == 1
    assert await store.purge(tenant="a", model="m") == 1
    assert await store.purge(model="n") == 1
    assert [await store.get(k, 0) is not None for k in keys] == [False, False, True, False]
    assert await store.purge() == 1
    await redis.aclose()


async def test_redis_killed_mid_traffic_degrades_to_local_and_resyncs(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        async with gateway(server.url) as one:
            await one.store("a", None, chat("what is the capital of peru"), ANSWER)
            server.stop()
            with anyio.fail_after(2):  # each call bounded by the Redis timeout, none raises
                for n in range(20):
                    hit = await one.lookup("a", None, chat("what is the capital of peru"), {})
                    assert hit is not None and hit.kind == "exact"  # from local memory
                    assert await one.lookup("a", None, chat(f"new question {n}"), {}) is None
                assert await one.store("a", None, chat("written while down"), ANSWER)
            stats = one.stats()
            assert stats["redis_errors"] + stats["redis_timeouts"] >= 1
            assert stats["redis_skipped"] >= 1  # the circuit kept later calls off Redis
            server.start()  # same port, empty
            await anyio.sleep(POLICY.cache.redis_retry_after_s + 0.1)

            async def backlog_flushed() -> bool:
                raw = Redis.from_url(server.url)
                try:
                    return int(await raw.xlen(STREAM)) >= 1
                finally:
                    await raw.aclose()

            assert await eventually(backlog_flushed)
            await one.store("a", None, chat("written after recovery"), ANSWER)
            async with gateway(server.url) as other:
                assert await other.lookup("a", None, chat("written after recovery"), {}) is not None
                semantic = await other.lookup("a", None, chat("written while down please"), {})
                assert semantic is not None and semantic.kind == "semantic"
    finally:
        server.stop()
