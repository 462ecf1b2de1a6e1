"""The gateway's admin API (``gateway.admin.api``) over an in-process cache, and the
cache counters the gateway's /metrics exports."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.shipped_policy import SEMANTIC_ON, shipped_policy
from gateway.admin.api import GatewayAdmin
from gateway.cache import ResponseCache
from gateway.cache.entry import CacheEntry
from gateway.admin.metrics import GatewayMetrics
from hedgerow.wire import RegistrySnapshot
from policies.schema import load_policy
from tests.support.cache_fakes import WordsEmbedder

pytestmark = pytest.mark.anyio

TOKEN = "tok-4e1f"


def chat(question: str) -> dict[str, Any]:
    return {"model": "smollm2", "temperature": 0,
            "messages": [{"role": "user", "content": question}]}


def answer(text: str) -> CacheEntry:
    return CacheEntry(text, "stop", 5, 3, "smollm2-135m-instruct", 1)


async def seeded(judge: str = "pair_model") -> ResponseCache:
    # The semantic part on (it ships off): a purge must empty it too, and its
    # refusals' counters are among the metrics.
    policy = shipped_policy({**SEMANTIC_ON, "semantic": {"enabled": True, "judge": judge}})
    cache = ResponseCache(policy, embedder=WordsEmbedder())
    for tenant in ("alice", "bob"):
        await cache.store(tenant, None, chat("Where do wrens nest?"), answer("In hedges."))
    return cache


def admin_client(cache: ResponseCache, token: str | None = TOKEN) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=GatewayAdmin(cache, TOKEN)),
                             base_url="http://admin", headers=headers)


async def test_purge_by_tenant_removes_only_that_tenants_answers() -> None:
    cache = await seeded()
    async with admin_client(cache) as admin:
        reply = await admin.post("/admin/cache/purge", json={"tenant": "alice"})
    assert reply.status_code == 200 and reply.json()["purged"] >= 1
    assert await cache.lookup("alice", None, chat("Where do wrens nest?")) is None
    bob = await cache.lookup("bob", None, chat("Where do wrens nest?"))
    assert bob is not None and bob.kind == "exact"


async def test_purge_by_model_alias_and_by_key() -> None:
    cache = await seeded()
    key = cache.keys("bob", None, chat("Where do wrens nest?")).exact
    async with admin_client(cache) as admin:
        by_key = await admin.post("/admin/cache/purge", json={"key": key})
        assert by_key.json()["purged"] >= 1
        assert await cache.lookup("bob", None, chat("Where do wrens nest?")) is None
        assert await cache.lookup("alice", None, chat("Where do wrens nest?")) is not None
        by_model = await admin.post("/admin/cache/purge", json={"model": "smollm2"})
        assert by_model.json()["purged"] >= 1
    assert await cache.lookup("alice", None, chat("Where do wrens nest?")) is None


async def test_a_wrong_or_missing_token_and_an_empty_purge_are_refused() -> None:
    cache = await seeded()
    for token in (None, "tok-wrong"):
        async with admin_client(cache, token) as admin:
            refused = await admin.post("/admin/cache/purge", json={"tenant": "alice"})
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_admin_token"
            assert (await admin.get("/admin/cache")).status_code == 401
    async with admin_client(cache) as admin:
        for body in ({}, {"tenant": ""}, {"everything": True}):
            assert (await admin.post("/admin/cache/purge", json=body)).status_code == 400
        stats = (await admin.get("/admin/cache")).json()
    assert stats["exact_entries"] == 2 and stats["semantic_ready"] is True
    assert stats["semantic_cache"] == "ready"


async def test_the_stats_say_the_semantic_cache_is_off_as_shipped() -> None:
    # An operator reading /admin/cache on a default gateway must not read "not
    # ready yet" and wait for an embedding model that will never start.
    cache = ResponseCache(shipped_policy(), embedder=WordsEmbedder())
    async with admin_client(cache) as admin:
        stats = (await admin.get("/admin/cache")).json()
    assert stats["semantic_cache"] == "off"


async def test_the_cache_counters_are_on_the_gateway_metrics() -> None:
    cache = await seeded(judge="cosine")  # the guards' reasons (the pair model's: its own tests)
    walk = "please tell me how far the walk along the old green hedge is, {} km in miles"
    await cache.store("alice", None, chat(walk.format(5)), answer("About 3 miles."))
    assert await cache.lookup("alice", None, chat(walk.format(50))) is None  # number guard
    metrics = GatewayMetrics()
    metrics.watch_cache(cache.stats)
    stats = {"counters": {}, "breakers": {}, "queued": {}, "inflight": {},
             "hedge_budget": {"level": 0.0}}
    text = metrics.render(stats, RegistrySnapshot(version=0)).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("hedgerow_cache_entries", (("kind", "exact"),))] == 3
    assert samples[("hedgerow_cache_redis_faults_total", (("kind", "timeout"),))] == 0
    assert samples[("hedgerow_cache_embedder_ready", ())] == 1
    assert samples[("hedgerow_cache_embeds_failed_total", (("reason", "lost"),))] == 0
    rejected = {k: v for k, v in samples.items()
                if k[0] == "hedgerow_cache_guard_rejections_total"}
    assert sum(rejected.values()) >= 1, text


async def test_with_the_semantic_cache_off_no_embedder_health_is_exported() -> None:
    # The shipped policy: its embedder is never started, so it is not "down"
    # (an alert on hedgerow_cache_embedder_ready == 0 would fire on every gateway).
    cache = ResponseCache(load_policy(), embedder=WordsEmbedder())
    assert not cache.policy.cache.semantic.enabled
    await cache.store("alice", None, chat("Where do wrens nest?"), answer("In hedges."))
    metrics = GatewayMetrics()
    metrics.watch_cache(cache.stats)
    stats = {"counters": {}, "breakers": {}, "queued": {}, "inflight": {},
             "hedge_budget": {"level": 0.0}}
    text = metrics.render(stats, RegistrySnapshot(version=0)).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "hedgerow_cache_entries" in names
    assert not {n for n in names if n.startswith(("hedgerow_cache_embedder", "hedgerow_cache_embeds"))}
