"""The semantic index (bounds, TTL, flat→HNSW, guards), batching, and the real model."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from gateway.cache import ResponseCache
from gateway.cache.embedder import MiniLmEmbedder
from gateway.cache.entry import CacheEntry
from gateway.cache.semantic import SemanticIndex, SemanticItem, SemanticMatch, SemanticMiss
from gateway.cache.store import Purge
from hedgerow.actors import Supervisor
from policies.loader import parse_policy_document
from tests.support.cache_fakes import WordsEmbedder, bag_of_words

pytestmark = pytest.mark.anyio

DIM = 384


def item(item_id: str, question: str, *, namespace: str = "ns", tenant: str = "a",
         expires: float = 1e12, vector: np.ndarray | None = None) -> SemanticItem:
    return SemanticItem(item_id, namespace, f"tenant:{tenant}", "m", f"key-{item_id}", question,
                        bag_of_words(question) if vector is None else vector,
                        CacheEntry(f"answer to {question}", "stop", 1, 1, "m", 0), expires)


def index(**kwargs: int) -> SemanticIndex:
    settings = {"max_entries_per_namespace": 100, "max_namespaces": 10, "hnsw_above": 50}
    settings.update(kwargs)
    return SemanticIndex(DIM, **settings)


def search(idx: SemanticIndex, question: str, *, namespace: str = "ns", now: float = 0,
           threshold: float = 0.8) -> SemanticMatch | SemanticMiss:
    return idx.search(namespace, bag_of_words(question), threshold, question, now)


def test_a_similar_question_hits_and_a_guarded_near_miss_does_not() -> None:
    idx = index()
    idx.add(item("1", "how far is 5 km in miles"), now=0)
    found = search(idx, "how far is 5 km in miles please")
    assert isinstance(found, SemanticMatch) and found.item.item_id == "1"
    refused = search(idx, "how far is 50 km in miles please")
    assert isinstance(refused, SemanticMiss) and refused.rejected_by == "numbers"
    assert refused.best_score >= 0.8


def test_namespaces_never_collide() -> None:
    idx = index()
    idx.add(item("1", "what is the capital of peru", namespace="tenant-a"), now=0)
    assert isinstance(search(idx, "what is the capital of peru", namespace="tenant-b"), SemanticMiss)


def test_entries_expire() -> None:
    idx = index()
    idx.add(item("1", "how do vaccines work", expires=10), now=0)
    assert isinstance(search(idx, "how do vaccines work", now=9), SemanticMatch)
    assert isinstance(search(idx, "how do vaccines work", now=10), SemanticMiss)
    assert len(idx) == 0


def test_entries_per_namespace_and_namespaces_are_bounded() -> None:
    idx = index(max_entries_per_namespace=3, max_namespaces=2)
    for n in range(5):
        idx.add(item(str(n), f"question number {n} about topic {n}"), now=0)
    assert len(idx) == 3
    assert isinstance(search(idx, "question number 0 about topic 0", threshold=0.99), SemanticMiss)
    assert isinstance(search(idx, "question number 4 about topic 4", threshold=0.99), SemanticMatch)
    idx.add(item("x", "other", namespace="two"), now=0)
    idx.add(item("y", "third", namespace="three"), now=0)  # evicts "ns", the least recent
    assert idx.namespace("ns") is None and len(idx) == 2


def test_a_large_namespace_switches_to_hnsw_and_still_finds_entries() -> None:
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(120, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    idx = index(hnsw_above=50, max_entries_per_namespace=100)
    for n, vector in enumerate(vectors):
        idx.add(item(str(n), f"topic {n}", vector=vector), now=0)
    space = idx.namespace("ns")
    assert space is not None and not space.hnsw and idx.rebuilds_wanted() == ["ns"]
    found = idx.search("ns", vectors[119], 0.99, "topic 119", now=0)  # still served, flat
    assert isinstance(found, SemanticMatch)
    idx.rebuild_now("ns")  # the cache does this on a worker thread
    assert space.hnsw and len(space) == 100 and idx.rebuilds_wanted() == []
    for n in (20, 77, 119):  # 0..19 were evicted
        found = idx.search("ns", vectors[n], 0.99, f"topic {n}", now=0)
        assert isinstance(found, SemanticMatch) and found.item.item_id == str(n)


def test_purge_by_tenant() -> None:
    idx = index()
    idx.add(item("1", "question one", tenant="a"), now=0)
    idx.add(item("2", "question two", tenant="b"), now=0)
    assert idx.purge(Purge(tenant="a")) == 1
    assert isinstance(search(idx, "question one"), SemanticMiss)
    assert isinstance(search(idx, "question two"), SemanticMatch)


class CountingModel:
    """Stands in for SentenceTransformer: records each batch it encodes."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def encode(self, texts: list[str], **_: Any) -> np.ndarray:
        self.batches.append(len(texts))
        return np.stack([bag_of_words(t) for t in texts])


async def test_concurrent_embeddings_are_batched_into_few_model_calls() -> None:
    model = CountingModel()
    embedder = MiniLmEmbedder(model=model, max_batch=16)
    results: dict[int, np.ndarray] = {}
    async with anyio.create_task_group() as tg:
        await tg.start(embedder.run)

        async def one(n: int) -> None:
            results[n] = await embedder.embed(f"question {n}")

        async with anyio.create_task_group() as callers:
            for n in range(40):
                callers.start_soon(one, n)
        tg.cancel_scope.cancel()
    assert len(results) == 40 and sum(model.batches) == 40
    assert len(model.batches) <= 5 and max(model.batches) == 16
    assert np.allclose(results[3], bag_of_words("question 3"))


POLICY = parse_policy_document("""
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants: [{name: a, class: interactive}, {name: b, class: interactive}]
models: [{name: m}]
cache: {semantic: {enabled: true}}
""")


def chat(question: str) -> dict[str, Any]:
    return {"model": "m", "temperature": 0,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": question}]}


async def test_the_real_model_serves_a_paraphrase_and_refuses_near_misses() -> None:
    """The sidecar's MiniLM and pair model through the facade: hit, refusals,
    tenant isolation."""
    cache = ResponseCache(POLICY)
    answer = CacheEntry("git rm the path, then commit.", "stop", 12, 5, "m", 1)
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        assert await cache.ready(120)
        assert await cache.store("a", None, chat("How do I remove a git submodule?"), answer)
        # Scores 0.998 (the shipped threshold is 0.99). Not every close rewording
        # does: the judge is strict where numbers and units are written another
        # way ("What's 5 km in miles?" scores 0.70 against "How far is 5 km in
        # miles?": a miss; docs/benchmarks.md). The training that makes the model
        # is seeded and single-machine deterministic: fresh VMs reproduced every
        # score of the evaluation sets to the fourth digit.
        hit = await cache.lookup("a", None, chat("What's the way to delete a git submodule?"), {})
        assert hit is not None and hit.kind == "semantic" and hit.entry == answer
        assert hit.score >= POLICY.cache.semantic.pair_threshold  # the pair model's score
        typed = await cache.lookup("a", None, chat("how do I remove a git submodule"), {})
        assert typed is not None and typed.kind == "semantic" and typed.score == 1.0
        for near_miss in ("How do I add a git submodule?", "How do I remove a git branch?",
                          "How do I not remove a git submodule?"):
            assert await cache.lookup("a", None, chat(near_miss), {}) is None, near_miss
        assert await cache.lookup("b", None, chat("What's the way to delete a git submodule?"),
                                  {}) is None
        exact = await cache.lookup("a", "m", chat("How do I remove a git submodule?"), {})
        assert exact is not None and exact.kind == "exact"
        tg.cancel_scope.cancel()


async def test_the_real_model_at_the_shipped_threshold_refuses_another_role_or_request() -> None:
    """At the shipped threshold (0.99) a rewording hits (the judge scores it 0.997);
    swapped roles, another thing in the same slot, and asking for a poem instead
    of a definition miss, though their cosine is high (0.98, 0.82, 0.69): the pair
    model reads both questions (0.001 each: they would miss at 0.5 too)."""
    cache = ResponseCache(POLICY)
    answer = CacheEntry("Not as a diet.", "stop", 12, 5, "m", 1)
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        assert await cache.ready(120)
        for question in ("can dogs eat cat food", "how do i clean a leather sofa", "what is a haiku"):
            assert await cache.store("a", None, chat(question), answer)
        hit = await cache.lookup("a", None, chat("is cat food ok for dogs to eat"), {})
        assert hit is not None and hit.kind == "semantic"
        for question in ("can cats eat dog food", "how do i clean a velvet armchair",
                         "write a haiku about autumn"):
            assert await cache.lookup("a", None, chat(question), {}) is None, question
        tg.cancel_scope.cancel()


async def test_lookup_bypass_and_uncacheable_requests() -> None:
    cache = ResponseCache(POLICY, embedder=WordsEmbedder())
    answer = CacheEntry("x", "stop", 1, 1, "m", 1)
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        await cache.store("a", None, chat("q"), answer)
        assert await cache.lookup("a", None, chat("q"), {"cache-control": "no-cache"}) is None
        assert await cache.lookup("a", None, chat("q"), [(b"Cache-Control", b"no-cache")]) is None
        assert await cache.lookup("a", None, chat("q"), {}) is not None
        hot = {**chat("q"), "temperature": 0.9}
        assert await cache.lookup("a", None, hot, {}) is None
        assert not await cache.store("a", None, hot, answer)
        assert not await cache.store("a", None, chat("r"), answer, {"cache-control": "no-store"})
        assert await cache.purge(tenant="a") >= 1
        assert await cache.lookup("a", None, chat("q"), {}) is None
        tg.cancel_scope.cancel()
    assert cache.stats()["bypass"] == 2


# The real pair model's scores sit near 0 or 1; the bag-of-words twin's
# (``WordsEmbedder.judge``) are cosines: tests of the machinery around the
# judge hold it to a threshold on its own scale.
TWIN_POLICY = parse_policy_document("""
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants: [{name: a, class: interactive}]
models: [{name: m}]
cache: {semantic: {enabled: true, pair_threshold: 0.8}}
""")


async def test_the_cache_runs_under_the_supervisor() -> None:
    cache = ResponseCache(TWIN_POLICY, embedder=WordsEmbedder())
    async with Supervisor() as supervisor:
        cache.start(supervisor)
        await cache.store("a", None, chat("what is a prime number"), CacheEntry("x", "stop", 1, 1, "m", 1))

        async def semantic_hit() -> bool:
            hit = await cache.lookup("a", None, chat("what is a prime number please"), {})
            return hit is not None and hit.kind == "semantic"

        with anyio.fail_after(5):
            while not await semantic_hit():
                await anyio.sleep(0.01)
        assert [child.name for child in supervisor.statistics()] == ["response-cache"]
    await cache.aclose()


async def test_a_large_namespace_is_rebuilt_as_hnsw_off_the_event_loop() -> None:
    policy = parse_policy_document(
        "models: [{name: m}]\n"
        "cache: {semantic: {enabled: true, hnsw_above: 20, pair_threshold: 0.8}}\n")
    cache = ResponseCache(policy, embedder=WordsEmbedder())
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        for n in range(30):
            await cache.store("a", None, chat(f"question {n} about item {n}"),
                              CacheEntry(str(n), "stop", 1, 1, "m", 1))
        with anyio.fail_after(5):
            while cache.semantic.rebuilds == 0:
                await anyio.sleep(0.01)
        hit = await cache.lookup("a", None, chat("question 29 about item 29 please"), {})
        assert hit is not None and hit.kind == "semantic" and hit.entry.text == "29"
        space = cache.semantic.index.namespace(cache.keys("a", None, chat("x")).semantic_namespace)
        assert space is not None and space.hnsw and len(space) == 30
        tg.cancel_scope.cancel()
