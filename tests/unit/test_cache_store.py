"""Exact stores: TTL, entry and byte bounds with LRU order; Redis faults as misses."""

from __future__ import annotations

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.cache.entry import CacheEntry
from gateway.cache.store import (
    ExactKey,
    Guarded,
    MemoryLru,
    MemoryStore,
    Purge,
    RedisCircuit,
    TieredStore,
)

pytestmark = pytest.mark.anyio


def entry(text: str = "answer") -> CacheEntry:
    return CacheEntry(text, "stop", 1, 1, "m", 0)


def key(name: str, tenant: str = "a", model: str = "m") -> ExactKey:
    return ExactKey(name, f"tenant:{tenant}", model)


def test_entries_expire_after_their_ttl() -> None:
    lru = MemoryLru(ttl_s=10, max_entries=10, max_bytes=10_000)
    lru.put(key("k"), entry(), now=100)
    assert lru.get(key("k"), now=109.9) == entry()
    assert lru.get(key("k"), now=110) is None
    assert len(lru) == 0 and lru.bytes == 0


def test_the_least_recently_used_entry_is_evicted_first() -> None:
    lru = MemoryLru(ttl_s=100, max_entries=2, max_bytes=10_000)
    lru.put(key("a"), entry(), now=0)
    lru.put(key("b"), entry(), now=0)
    assert lru.get(key("a"), now=1) is not None  # a is now the most recent
    lru.put(key("c"), entry(), now=2)
    assert lru.get(key("b"), now=3) is None
    assert lru.get(key("a"), now=3) is not None and lru.get(key("c"), now=3) is not None
    assert lru.evictions == 1


def test_the_byte_bound_holds_and_oversized_entries_are_not_kept() -> None:
    big = entry("x" * 400)
    lru = MemoryLru(ttl_s=100, max_entries=100, max_bytes=3 * big.size)
    for index in range(10):
        lru.put(key(str(index)), big, now=index)
        assert lru.bytes <= 3 * big.size
    assert len(lru) == 3 and lru.get(key("9"), now=10) is not None
    lru.put(key("huge"), entry("y" * 10_000), now=11)
    assert lru.get(key("huge"), now=11) is None and len(lru) == 3


def test_replacing_an_entry_keeps_the_byte_count_right() -> None:
    lru = MemoryLru(ttl_s=100, max_entries=10, max_bytes=10_000)
    lru.put(key("k"), entry("short"), now=0)
    lru.put(key("k"), entry("a much longer answer"), now=0)
    assert len(lru) == 1 and lru.bytes == entry("a much longer answer").size


def test_purge_by_tenant_model_and_key() -> None:
    lru = MemoryLru(ttl_s=100, max_entries=10, max_bytes=10_000)
    lru.put(key("1", "a", "m"), entry(), 0)
    lru.put(key("2", "a", "n"), entry(), 0)
    lru.put(key("3", "b", "m"), entry(), 0)
    lru.put(key("4", "b", "n"), entry(), 0)
    assert lru.purge(Purge(key="4")) == 1
    assert lru.purge(Purge(tenant="a", model="m")) == 1
    assert lru.purge(Purge(model="n")) == 1
    assert lru.get(key("3", "b", "m"), 1) is not None and len(lru) == 1


class BrokenRemote:
    """A Redis that fails or hangs, as a killed or overloaded one does."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls = 0
        self.data: dict[str, CacheEntry] = {}

    async def _fail(self) -> None:
        self.calls += 1
        if self.mode == "down":
            raise RedisConnectionError("Connection refused")
        if self.mode == "slow":
            await anyio.sleep(5)

    async def get(self, key: ExactKey, now: float) -> CacheEntry | None:
        await self._fail()
        return self.data.get(key.digest)

    async def put(self, key: ExactKey, entry: CacheEntry, now: float) -> None:
        await self._fail()
        self.data[key.digest] = entry

    async def purge(self, tenant: str | None = None, model: str | None = None,
                    key: str | None = None) -> int:
        await self._fail()
        return 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tiered(remote: BrokenRemote, clock: Clock) -> TieredStore:
    guard = Guarded(0.05, RedisCircuit(retry_after_s=5), clock)
    return TieredStore(MemoryStore(100, 100, 100_000), remote, guard)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["down", "slow"])
async def test_a_failing_redis_is_a_miss_and_local_entries_still_serve(mode: str) -> None:
    clock = Clock()
    remote = BrokenRemote(mode)
    store = tiered(remote, clock)
    with anyio.fail_after(1):  # a hanging Redis costs the timeout, not the request
        assert await store.get(key("k"), clock.now) is None
        await store.put(key("k"), entry(), clock.now)  # local write still happens
        assert await store.get(key("k"), clock.now) == entry()
    assert store.guard.circuit.faults == 1
    assert (store.guard.errors, store.guard.timeouts) == ((1, 0) if mode == "down" else (0, 1))


async def test_redis_is_skipped_while_the_circuit_is_open_then_tried_again() -> None:
    clock = Clock()
    remote = BrokenRemote("down")
    store = tiered(remote, clock)
    await store.get(key("x"), clock.now)
    assert remote.calls == 1
    for name in "abc":
        assert await store.get(key(name), clock.now) is None
    assert remote.calls == 1 and store.guard.skipped == 3
    remote.mode = "up"
    remote.data["shared"] = entry("from another gateway")
    clock.now += 5
    assert await store.get(key("shared"), clock.now) == entry("from another gateway")
    assert remote.calls == 2
    # ... and it was copied to local memory: no Redis call the second time.
    assert await store.get(key("shared"), clock.now) == entry("from another gateway")
    assert remote.calls == 2
