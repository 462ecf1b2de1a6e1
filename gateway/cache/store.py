"""Exact-match stores: in-process (bounded LRU), Redis (shared), and both.

Every store answers ``get(key, now)``, ``put(key, entry, now)`` and
``purge(tenant=, model=, key=)``; keys are ``ExactKey``s (digest plus the
namespace and model they belong to, which purging needs).

``MemoryStore`` is sans-IO: time is a parameter, bounds are entries, bytes and
TTL, and the least recently used entry goes first. ``RedisStore`` leaves TTL
to Redis (``SET EX``) and keeps one index set per namespace and per model so
purges need no SCAN. ``TieredStore`` reads local first, then Redis, writes
both, and never lets a Redis fault reach the caller: an error or a call slower
than the timeout is logged and counted, the request proceeds as a miss, and
Redis is skipped for a while (``RedisCircuit``) before it is tried again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.cache.entry import CacheEntry, EntryDecodeError

log = logging.getLogger("hedgerow.cache")

PREFIX = "hedgerow:cache:exact:"
T = TypeVar("T")


@dataclass(frozen=True)
class ExactKey:
    digest: str
    namespace: str  # "tenant:NAME" / "shared:NAME"
    model: str


@dataclass(frozen=True)
class Purge:
    """What to purge; None matches anything. A tenant matches its own namespace."""

    tenant: str | None = None
    model: str | None = None
    key: str | None = None

    def matches(self, key: ExactKey) -> bool:
        return ((self.tenant is None or key.namespace == f"tenant:{self.tenant}")
                and (self.model is None or key.model == self.model)
                and (self.key is None or key.digest == self.key))


class ExactStore(Protocol):
    async def get(self, key: ExactKey, now: float) -> CacheEntry | None: ...

    async def put(self, key: ExactKey, entry: CacheEntry, now: float) -> None: ...

    async def purge(self, tenant: str | None = None, model: str | None = None,
                    key: str | None = None) -> int: ...


@dataclass
class _Slot:
    key: ExactKey
    entry: CacheEntry
    expires: float


class MemoryLru:
    """The in-process cache itself, synchronous: TTL, entry and byte bounds, LRU."""

    def __init__(self, ttl_s: float, max_entries: int, max_bytes: int) -> None:
        self.ttl_s, self.max_entries, self.max_bytes = ttl_s, max_entries, max_bytes
        self._slots: OrderedDict[str, _Slot] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, key: ExactKey, now: float) -> CacheEntry | None:
        slot = self._slots.get(key.digest)
        if slot is None:
            return None
        if slot.expires <= now:
            self._drop(key.digest)
            return None
        self._slots.move_to_end(key.digest)
        return slot.entry

    def put(self, key: ExactKey, entry: CacheEntry, now: float, ttl_s: float | None = None) -> None:
        if entry.size > self.max_bytes:
            return
        if key.digest in self._slots:
            self._drop(key.digest)
        self._slots[key.digest] = _Slot(key, entry, now + (ttl_s or self.ttl_s))
        self.bytes += entry.size
        while len(self._slots) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._slots)))
            self.evictions += 1

    def purge(self, what: Purge) -> int:
        doomed = [digest for digest, slot in self._slots.items() if what.matches(slot.key)]
        for digest in doomed:
            self._drop(digest)
        return len(doomed)

    def purge_all(self) -> int:
        return self.purge(Purge())

    def resize(self, ttl_s: float, max_entries: int, max_bytes: int) -> None:
        self.ttl_s, self.max_entries, self.max_bytes = ttl_s, max_entries, max_bytes

    def _drop(self, digest: str) -> None:
        slot = self._slots.pop(digest)
        self.bytes -= slot.entry.size


class MemoryStore:
    """``MemoryLru`` behind the async ``ExactStore`` protocol."""

    def __init__(self, ttl_s: float, max_entries: int, max_bytes: int) -> None:
        self.lru = MemoryLru(ttl_s, max_entries, max_bytes)

    async def get(self, key: ExactKey, now: float) -> CacheEntry | None:
        return self.lru.get(key, now)

    async def put(self, key: ExactKey, entry: CacheEntry, now: float) -> None:
        self.lru.put(key, entry, now)

    async def purge(self, tenant: str | None = None, model: str | None = None,
                    key: str | None = None) -> int:
        return self.lru.purge(Purge(tenant, model, key))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _index(kind: str, value: str) -> str:
    return f"{PREFIX}idx:{kind}:{value}"


class RedisStore:
    """Entries in Redis under ``hedgerow:cache:exact:<digest>``, expired by Redis."""

    def __init__(self, redis: Redis, ttl_s: float) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def get(self, key: ExactKey, now: float) -> CacheEntry | None:
        data = await self.redis.get(PREFIX + key.digest)
        if data is None:
            return None
        try:
            return CacheEntry.decode(data)
        except EntryDecodeError:
            log.warning("cache entry %s in Redis is unreadable; ignored", key.digest)
            return None

    async def put(self, key: ExactKey, entry: CacheEntry, now: float) -> None:
        ttl = max(1, round(self.ttl_s))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(PREFIX + key.digest, entry.encode(), ex=ttl)
            # Index sets outlive their members by at most one TTL; purges skip the dead.
            for index in (_index("ns", key.namespace), _index("model", key.model)):
                pipe.sadd(index, key.digest)
                pipe.expire(index, ttl)
            await pipe.execute()

    async def purge(self, tenant: str | None = None, model: str | None = None,
                    key: str | None = None) -> int:
        if key is not None:
            return int(await self.redis.delete(PREFIX + key))
        digests = await self._purge_candidates(tenant, model)
        if digests is None:
            return await self._purge_all()
        if not digests:
            return 0
        removed = int(await self.redis.delete(*(PREFIX + d for d in digests)))
        async with self.redis.pipeline(transaction=False) as pipe:
            for index in (_index("ns", f"tenant:{tenant}") if tenant else None,
                          _index("model", model) if model else None):
                if index is not None:
                    pipe.srem(index, *digests)
            await pipe.execute()
        return removed

    async def _purge_candidates(self, tenant: str | None, model: str | None) -> set[str] | None:
        sets = [_index("ns", f"tenant:{tenant}") if tenant else None,
                _index("model", model) if model else None]
        names = [s for s in sets if s is not None]
        if not names:
            return None
        members: list[bytes] = await self.redis.sinter(names)  # type: ignore[misc]
        return {_text(m) for m in members}

    async def _purge_all(self) -> int:
        removed = 0
        async for name in self.redis.scan_iter(match=PREFIX + "*", count=500):
            deleted = int(await self.redis.delete(name))
            removed += 0 if _text(name).startswith(PREFIX + "idx:") else deleted
        return removed


@dataclass
class RedisCircuit:
    """After a Redis fault, skip Redis for ``retry_after_s``; then try it again (sans-IO)."""

    retry_after_s: float
    open_until: float = 0.0
    faults: int = 0
    last_reason: str = ""

    def allows(self, now: float) -> bool:
        return now >= self.open_until

    def fault(self, now: float, reason: str) -> None:
        self.faults += 1
        self.last_reason = reason
        self.open_until = now + self.retry_after_s


@dataclass
class Guarded:
    """Runs Redis calls with a timeout; a fault opens the circuit and yields a default."""

    timeout_s: float
    circuit: RedisCircuit
    clock: Callable[[], float]
    timeouts: int = 0
    errors: int = 0
    skipped: int = 0
    what: str = "cache"
    _logged_open: bool = field(default=False, repr=False)

    async def call(self, work: Callable[[], Awaitable[T]], default: T) -> T:
        if not self.circuit.allows(self.clock()):
            self.skipped += 1
            return default
        try:
            with anyio.fail_after(self.timeout_s):
                result = await work()
        except TimeoutError:
            self.timeouts += 1
            return self._fault(default, f"slower than {self.timeout_s * 1000:.0f} ms")
        except (RedisError, OSError) as error:
            self.errors += 1
            return self._fault(default, f"{type(error).__name__}: {error}")
        if self._logged_open:
            log.info("Redis %s is back; using it again", self.what)
            self._logged_open = False
        return result

    def _fault(self, default: T, reason: str) -> T:
        self.circuit.fault(self.clock(), reason)
        if not self._logged_open:
            log.warning("Redis %s fault (%s): serving from local memory for %.1f s",
                        self.what, reason, self.circuit.retry_after_s)
            self._logged_open = True
        return default


class TieredStore:
    """Local memory in front of Redis; Redis faults become misses, never errors."""

    def __init__(self, local: MemoryStore, remote: RedisStore | None, guard: Guarded) -> None:
        self.local = local
        self.remote = remote
        self.guard = guard

    async def get(self, key: ExactKey, now: float) -> CacheEntry | None:
        entry = await self.local.get(key, now)
        if entry is not None or self.remote is None:
            return entry
        remote = self.remote
        entry = await self.guard.call(lambda: remote.get(key, now), None)
        if entry is not None:
            await self.local.put(key, entry, now)
        return entry

    async def put(self, key: ExactKey, entry: CacheEntry, now: float) -> None:
        await self.local.put(key, entry, now)
        if self.remote is not None:
            remote = self.remote
            await self.guard.call(lambda: remote.put(key, entry, now), None)

    async def purge(self, tenant: str | None = None, model: str | None = None,
                    key: str | None = None) -> int:
        removed = await self.local.purge(tenant, model, key)
        if self.remote is not None:
            remote = self.remote
            removed = max(removed, await self.guard.call(
                lambda: remote.purge(tenant, model, key), 0))
        return removed
