"""The embedding model runs only while the policy uses it.

MiniLM's sidecar process holds about 400 MB: a gateway whose policy leaves the
semantic cache off (the default) or turns the response cache off must not
start it, a policy that turns it on later starts it without a restart, and one
that turns it off stops it again."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from gateway.cache import ResponseCache
from gateway.cache.embedder import DIM
from policies.loader import parse_policy_document
from policies.schema import Policy, load_policy

SEMANTIC_ON = "cache: {enabled: true, semantic: {enabled: true}}"
BASE = """
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants: [{name: a, class: interactive}]
models: [{name: m}]
"""

pytestmark = pytest.mark.anyio


def policy(cache: str) -> Policy:
    return parse_policy_document(BASE + cache)


class RecordingEmbedder:
    """An embedder whose ``run`` (the sidecar's life) is recorded."""

    dim = DIM

    def __init__(self) -> None:
        self.ready = False
        self.runs = 0
        self.stopped = 0

    async def embed(self, text: str) -> np.ndarray:
        return np.ones(DIM, dtype=np.float32) / np.sqrt(DIM)

    async def run(self) -> None:
        self.runs += 1
        self.ready = True
        try:
            await anyio.sleep_forever()
        finally:
            self.ready = False
            self.stopped += 1


async def settle() -> None:
    for _ in range(10):
        await anyio.sleep(0)


async def test_a_policy_without_the_cache_starts_no_embedder_until_one_turns_it_on() -> None:
    embedder = RecordingEmbedder()
    cache = ResponseCache(policy("cache: {enabled: false}"), embedder=embedder)
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        await settle()
        assert embedder.runs == 0
        cache.apply_policy(policy("cache: {semantic: {enabled: false}}"))
        await settle()
        assert embedder.runs == 0  # the exact cache needs no model
        cache.apply_policy(policy("cache: {enabled: true}"))
        await settle()
        assert embedder.runs == 0  # the cache on, its semantic part off by default
        cache.apply_policy(policy(SEMANTIC_ON))
        await settle()
        assert (embedder.runs, embedder.ready) == (1, True)
        cache.apply_policy(policy(SEMANTIC_ON))
        await settle()
        assert embedder.runs == 1  # the same policy again: the same process
        cache.apply_policy(policy("cache: {enabled: false, semantic: {enabled: true}}"))
        await settle()
        assert (embedder.stopped, embedder.ready) == (1, False)
        cache.apply_policy(policy(SEMANTIC_ON))
        await settle()
        assert embedder.runs == 2
        cache.apply_policy(policy("cache: {enabled: true}"))  # back to the default
        await settle()
        assert (embedder.stopped, embedder.ready) == (2, False)
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("default", [policy(""), load_policy()], ids=["schema", "default.yaml"])
async def test_the_default_policy_starts_no_embedder(default: Policy) -> None:
    assert default.cache.enabled and default.cache.exact.enabled
    assert not default.cache.semantic.enabled
    embedder = RecordingEmbedder()
    cache = ResponseCache(default, embedder=embedder)
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        await settle()
        assert (embedder.runs, embedder.ready) == (0, False)
        tg.cancel_scope.cancel()


async def test_a_policy_that_turns_semantic_on_starts_the_embedder_at_once() -> None:
    embedder = RecordingEmbedder()
    cache = ResponseCache(policy("cache: {semantic: {enabled: true}}"), embedder=embedder)
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        await settle()
        assert embedder.runs == 1
        tg.cancel_scope.cancel()
