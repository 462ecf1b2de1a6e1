"""The registry and the policy store in a real Redis, as replicas share them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from redis.asyncio import Redis

from control_plane.policy_store import PolicyStore
from control_plane.redis_policy import RedisPolicyStore
from control_plane.redis_registry import RedisRegistry
from hedgerow.errors import UnknownPolicyVersion, UnknownWorker
from hedgerow.wire import WorkerLoad, WorkerRegistration
from policies.loader import parse_policy_document
from policies.schema import PolicyError
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

pytestmark = pytest.mark.anyio


def doc(max_tokens: int) -> str:
    return f"limits: {{max_tokens: {max_tokens}}}\n"


def worker(worker_id: str) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, url=f"http://127.0.0.1:1/{worker_id}",
                              kind="cpu", models=("m",), slots=2)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    await client.flushdb()
    try:
        yield client
    finally:
        await client.aclose()


async def seeded(redis: Redis, keep: int = 100) -> RedisPolicyStore:
    store = RedisPolicyStore(redis, keep=keep)
    first = PolicyStore(parse_policy_document(doc(100)), doc(100), source="boot", now=1.0)
    await store.seed(first.current)
    return store


async def test_registered_workers_are_listed_with_their_load(redis: Redis) -> None:
    registry = RedisRegistry(redis, lease_s=5)
    await registry.register(worker("b"))
    await registry.register(worker("a"))
    await registry.heartbeat("a", WorkerLoad(active=1))
    snapshot = await registry.snapshot()
    assert [w.registration.worker_id for w in snapshot.workers] == ["a", "b"]
    assert snapshot.workers[0].load.active == 1
    assert 4.0 < snapshot.workers[0].lease_expires_in_s <= 5.0
    assert snapshot.version == 3


async def test_a_heartbeat_with_unchanged_load_keeps_the_version(redis: Redis) -> None:
    registry = RedisRegistry(redis, lease_s=5)
    await registry.register(worker("a"))
    await registry.heartbeat("a", WorkerLoad(active=1))
    before = await registry.version()
    await registry.heartbeat("a", WorkerLoad(active=1))
    assert await registry.version() == before


async def test_a_lease_runs_out_in_redis_and_one_replica_reports_it(redis: Redis) -> None:
    replica_a, replica_b = RedisRegistry(redis, lease_s=0.3), RedisRegistry(redis, lease_s=0.3)
    await replica_a.register(worker("w1"))
    await replica_a.register(worker("w2"))
    await anyio.sleep(0.2)
    await replica_b.heartbeat("w2", WorkerLoad())  # w2 renewed through the other replica
    await anyio.sleep(0.2)
    before = await replica_a.version()
    assert await replica_a.expire() == ("w1",)
    assert await replica_b.expire() == ()  # already gone: no second version bump
    assert await replica_b.version() == before + 1
    assert [w.registration.worker_id for w in (await replica_b.snapshot()).workers] == ["w2"]
    with pytest.raises(UnknownWorker):
        await replica_b.heartbeat("w1", WorkerLoad())


async def test_deregistered_workers_are_gone_and_unknown_ones_refused(redis: Redis) -> None:
    registry = RedisRegistry(redis, lease_s=5)
    await registry.register(worker("a"))
    await registry.deregister("a")
    assert (await registry.snapshot()).workers == ()
    with pytest.raises(UnknownWorker):
        await registry.deregister("a")


async def test_a_full_registry_refuses_new_workers_but_not_known_ones(redis: Redis) -> None:
    registry = RedisRegistry(redis, lease_s=5, max_workers=1)
    await registry.register(worker("a"))
    await registry.register(worker("a"))
    with pytest.raises(OverflowError):
        await registry.register(worker("b"))


async def test_the_version_counter_is_lifted_after_redis_lost_it(redis: Redis) -> None:
    registry = RedisRegistry(redis, lease_s=5)
    assert not await registry.ensure_version_at_least(0)
    assert await registry.ensure_version_at_least(7)
    assert await registry.version() == 8


async def test_applied_policies_get_increasing_versions_and_history(redis: Redis) -> None:
    store = await seeded(redis)
    v2, changed = await store.apply(doc(200), "a.yaml", now=2.0)
    assert (v2.version, changed) == (2, True)
    assert v2.policy.limits.max_tokens == 200
    same, changed = await store.apply(doc(200) + "# only a comment\n", "b.yaml", now=3.0)
    assert (same.version, changed) == (2, False)
    history = await store.history()
    assert [(h.version, h.source) for h in history] == [(1, "boot"), (2, "a.yaml")]
    assert (await RedisPolicyStore(redis).current()).text == doc(200)  # another replica


async def test_an_invalid_policy_changes_nothing(redis: Redis) -> None:
    store = await seeded(redis)
    with pytest.raises(PolicyError):
        await store.apply("limits: {max_tokenz: 1}\n", "typo.yaml", now=2.0)
    assert await store.current_version() == 1


async def test_rollback_is_a_new_version_with_old_content(redis: Redis) -> None:
    store = await seeded(redis)
    await store.apply(doc(200), "a.yaml", now=2.0)
    back, changed = await store.rollback(1, now=3.0)
    assert (back.version, changed, back.source) == (3, True, "rollback to v1")
    assert (await store.current()).policy.limits.max_tokens == 100
    with pytest.raises(UnknownPolicyVersion):
        await store.get(42)


async def test_only_the_newest_versions_are_kept(redis: Redis) -> None:
    store = await seeded(redis, keep=2)
    for tokens in (200, 300, 400):
        await store.apply(doc(tokens), "x.yaml", now=2.0)
    assert [h.version for h in await store.history()] == [3, 4]
    with pytest.raises(UnknownPolicyVersion, match="3..4"):
        await store.get(1)


async def test_concurrent_applies_on_two_replicas_get_distinct_versions(redis: Redis) -> None:
    replica_a, replica_b = await seeded(redis), RedisPolicyStore(redis)
    results: list[int] = []

    async def apply(store: RedisPolicyStore, tokens: int) -> None:
        version, changed = await store.apply(doc(tokens), f"{tokens}.yaml", now=2.0)
        assert changed
        results.append(version.version)

    async with anyio.create_task_group() as tg:
        for tokens in range(200, 210):
            tg.start_soon(apply, replica_a if tokens % 2 else replica_b, tokens)
    assert sorted(results) == list(range(2, 12))
    assert [h.version for h in await replica_b.history()] == list(range(1, 12))


async def test_seeding_never_overwrites_a_store_in_use(redis: Redis) -> None:
    store = await seeded(redis)
    await store.apply(doc(200), "a.yaml", now=2.0)
    other = PolicyStore(parse_policy_document(doc(999)), doc(999), source="other", now=1.0)
    number, _ = await store.seed(other.current)
    assert number == 2 and (await store.current()).policy.limits.max_tokens == 200
