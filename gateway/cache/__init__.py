"""Hedgerow's response cache: exact, then semantic; local, shared through Redis.

The facade the request path uses is ``ResponseCache``::

    cache = ResponseCache(policy, redis_url)       # redis_url None: in-process only
    # rediss:// with a CA (and client certificate): redis_tls=RedisTls(ca_file, ...)
    async with Supervisor() as supervisor:
        cache.start(supervisor)                    # or: await task_group.start(cache.run)
        ...
        hit = await cache.lookup(tenant, model, body, headers)
        if hit is not None:                        # x-hedgerow-cache: hit.kind
            chunks = hit.sse(request_id, model=requested_model, include_usage=...)
            body = hit.json(request_id, model=requested_model)
        else:                                      # x-hedgerow-cache: miss
            ... generate; after a complete, successful answer:
            await cache.store(tenant, model, body, entry_or_response_body, headers)
    await cache.aclose()

Contract:

- ``lookup(tenant, model, request_json, headers)``: ``tenant`` is the name
  from ``policies.tenancy.identify``; ``model`` the model the request names
  (alias or canonical; None: ``request_json["model"]``); ``request_json`` the
  parsed JSON body as a dict (already validated by ``oa.parse_request``);
  ``headers`` a mapping of lower-case names (or ASGI ``(bytes, bytes)`` pairs).
  Returns ``Hit`` or None. None when: the cache or this kind is disabled, the
  request is not cacheable (not deterministic and not opted in; ``store: true``;
  ``n > 1``), ``cache-control: no-cache``/``no-store`` asks to bypass, nothing
  matches, or anything in the cache failed (Redis down or slower than
  ``redis_timeout_ms``, embedder busy). It never raises for a cache fault.
- ``store(tenant, model, request_json, answer, headers)``: call once per
  finished, successful answer that was a miss (not for hits). ``answer`` is a
  ``CacheEntry`` (``EntryBuilder`` collects one from the relayed stream's
  chunks) or the non-streaming response body (``entry_from_response``). It
  need not be awaited on the request path: run it after the response is sent
  (it may embed the question, tens of ms on a thread). Not stored when
  the request is not cacheable or says ``cache-control: no-store``. Returns
  whether it was stored. Never raises for a cache fault.
- ``Hit.sse(...)`` gives the bytes of a live-shaped SSE stream (role chunk,
  content chunks of a few words, finish chunk, usage chunk when asked,
  ``data: [DONE]``); ``Hit.json(...)`` the non-streaming body. Both carry the
  cached ``usage``.
- ``purge(tenant=, model=, key=)``: removes matching entries here and in Redis
  (semantic purges reach every gateway through the shared stream); returns how
  many this gateway removed. ``key`` is an exact key (``Hit.key``); ``tenant``
  matches the tenant's own namespace, not a shared one (purge shared entries
  by model or key). Other gateways drop their in-memory copies when the purge
  reaches them through the stream (about a second); while Redis is down it
  reaches them when Redis returns. Bumping a model's ``version`` in the
  policy invalidates its entries everywhere at once.
- Latency: an exact hit is a dict lookup (plus one Redis GET, bounded by
  ``redis_timeout_ms``, when local memory misses). A semantic lookup embeds
  the last user message (one model call in the embedder, batched with
  concurrent ones) only when its namespace holds entries; otherwise it costs nothing.
- ``apply_policy(policy)``: new thresholds, TTLs and bounds for later requests.
- ``run`` (supervised): starts the embedder (by default ``SidecarEmbedder``:
  the model in a child process) and follows the semantic stream in Redis; it
  reports started once the semantic index is rebuilt (or Redis is found
  down), while the model may still be loading —
  until it has, semantic lookups are misses. ``ready()`` waits for the model.
- ``stats()``: counters for metrics (hits by kind, misses, Redis faults, guard
  rejections by reason, evictions).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio
import numpy as np
from anyio.abc import TaskStatus
from redis.asyncio import Redis

from gateway.cache.embed_sidecar import SidecarEmbedder
from gateway.cache.embedder import Embedder, PairJudge
from gateway.cache.entry import (
    CacheEntry,
    EntryBuilder,
    entry_from_response,
    ReplayKind,
    json_replay,
    replay_events,
    sse_replay,
)
from gateway.cache.keys import CacheKeys, bypasses_lookup, cache_keys, cacheable, forbids_store
from gateway.cache.semantic import SemanticIndex, SemanticMatch
from gateway.cache.semantic_cache import SemanticCache, SemanticSettings
from gateway.cache.store import ExactKey, Guarded, MemoryStore, Purge, RedisCircuit, RedisStore, TieredStore
from hedgerow.actors import Supervisor
from hedgerow.redis_conn import RedisTls, open_redis
from policies.schema import Policy

__all__ = ["CacheEntry", "EntryBuilder", "Hit", "ResponseCache", "entry_from_response"]

log = logging.getLogger("hedgerow.cache")

MAX_REMEMBERED_VECTORS = 1024
STORE_EMBED_TIMEOUT_S = 2.0

HeadersLike = Mapping[str, str] | Iterable[tuple[bytes, bytes]]


@dataclass(frozen=True)
class Hit:
    kind: Literal["exact", "semantic"]
    entry: CacheEntry
    key: str  # the exact key of this request
    score: float = 1.0  # cosine similarity for a semantic hit

    def sse(self, request_id: str, *, model: str | None = None,
            include_usage: bool = False) -> Iterator[bytes]:
        return sse_replay(self.entry, request_id, model=model, include_usage=include_usage)

    def events(self, request_id: str, *, model: str | None = None,
               include_usage: bool = False) -> Iterator[tuple[ReplayKind, bytes]]:
        """``sse``'s events with their kinds (for a stream log: nothing to parse back)."""
        return replay_events(self.entry, request_id, model=model, include_usage=include_usage)

    def json(self, request_id: str, *, model: str | None = None) -> dict[str, Any]:
        return json_replay(self.entry, request_id, model=model)


def _headers(headers: HeadersLike | None) -> Mapping[str, str]:
    if headers is None:
        return {}
    if isinstance(headers, Mapping):
        return {str(k).lower(): str(v) for k, v in headers.items()}
    return {bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1") for k, v in headers}


class ResponseCache:
    def __init__(self, policy: Policy, redis_url: str | None = None, *,
                 embedder: Embedder | None = None, judge: PairJudge | None = None,
                 clock: Callable[[], float] = time.time,
                 origin: str | None = None, redis_tls: RedisTls = RedisTls()) -> None:
        self.policy = policy
        self.clock = clock
        settings = policy.cache
        self.redis: Redis | None = (
            open_redis(redis_url, redis_tls, connect_timeout=1.0, socket_timeout=5.0)
            if redis_url else None)
        self.guard = Guarded(settings.redis_timeout_ms / 1000,
                             RedisCircuit(settings.redis_retry_after_s), clock)
        local = MemoryStore(settings.exact.ttl_s, settings.exact.max_entries,
                            settings.exact.max_bytes)
        self.remote = RedisStore(self.redis, settings.exact.ttl_s) if self.redis else None
        self.exact = TieredStore(local, self.remote, self.guard)
        # MiniLM runs in a sidecar process so that torch never loads into the
        # gateway's (docs/architecture.md); MiniLmEmbedder runs it in-process.
        self.embedder = embedder if embedder is not None else SidecarEmbedder()
        semantic = settings.semantic
        index = SemanticIndex(self.embedder.dim,
                              max_entries_per_namespace=semantic.max_entries_per_namespace,
                              max_namespaces=semantic.max_namespaces,
                              hnsw_above=semantic.hnsw_above)
        self.semantic = SemanticCache(index, self.embedder, SemanticSettings.of(semantic),
                                      self.redis, self.guard, origin=origin,
                                      on_remote_purge=self.exact.local.lru.purge, judge=judge)
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self.counts: dict[str, int] = {"exact": 0, "semantic": 0, "miss": 0, "bypass": 0,
                                       "uncacheable": 0, "stored": 0}
        self._policy_applied = anyio.Event()
        self._embedder_scope: anyio.CancelScope | None = None

    # -- configuration and lifecycle -------------------------------------

    def apply_policy(self, policy: Policy) -> None:
        self.policy = policy
        if self._embedder_scope is not None and not self.wants_embedder():
            log.info("semantic cache off: stopping the embedder")
            self._embedder_scope.cancel()
        applied, self._policy_applied = self._policy_applied, anyio.Event()
        applied.set()
        settings = policy.cache
        self.exact.local.lru.resize(settings.exact.ttl_s, settings.exact.max_entries,
                                    settings.exact.max_bytes)
        if self.remote is not None:
            self.remote.ttl_s = settings.exact.ttl_s
        self.guard.timeout_s = settings.redis_timeout_ms / 1000
        self.guard.circuit.retry_after_s = settings.redis_retry_after_s
        semantic = settings.semantic
        self.semantic.settings = replace(SemanticSettings.of(semantic),
                                         embed_timeout_s=self.semantic.settings.embed_timeout_s)
        self.semantic.index.configure(max_entries_per_namespace=semantic.max_entries_per_namespace,
                                      max_namespaces=semantic.max_namespaces,
                                      hnsw_above=semantic.hnsw_above)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The embedder and the semantic follower; started once the index is rebuilt."""
        async with anyio.create_task_group() as tg:
            run_embedder = getattr(self.embedder, "run", None)
            if run_embedder is not None:
                tg.start_soon(self._embedder_while_wanted, run_embedder)
            await tg.start(self.semantic.run)
            task_status.started()

    def wants_embedder(self) -> bool:
        """Only a policy whose cache and semantic cache are both on uses the model:
        otherwise its process (about 400 MB resident) is not started at all."""
        return self.policy.cache.semantic_on

    async def _embedder_while_wanted(self, run_embedder: Callable[[], Awaitable[None]]) -> None:
        """Run the embedder while the policy wants it: started when a policy turns the
        semantic cache on, stopped (its process killed) when one turns it off."""
        while True:
            while not self.wants_embedder():
                await self._policy_applied.wait()
            with anyio.CancelScope() as scope:
                self._embedder_scope = scope
                await run_embedder()
                return  # an embedder that gave up stays down, as before
            self._embedder_scope = None

    def start(self, supervisor: Supervisor) -> None:
        """Run the cache's background work under ``supervisor`` (restarted on crash)."""
        supervisor.run_service("response-cache", self.run)

    async def ready(self, timeout_s: float = 120.0) -> bool:
        """Wait until the embedding model is loaded; False if it was not in time."""
        with anyio.move_on_after(timeout_s):
            while not getattr(self.embedder, "ready", True):
                await anyio.sleep(0.05)
            return True
        return False

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    # -- the request path ------------------------------------------------

    def keys(self, tenant: str, model: str | None, request_json: Mapping[str, Any]) -> CacheKeys:
        request = request_json if model is None else {**request_json, "model": model}
        return cache_keys(tenant, request, self.policy)

    async def lookup(self, tenant: str, model: str | None, request_json: Mapping[str, Any],
                     headers: HeadersLike | None = None, *,
                     keys: CacheKeys | None = None) -> Hit | None:
        """``keys``: this request's, from ``keys`` (computed once per request, and
        carried on to ``store``); given, the caller has found it ``cacheable``."""
        settings = self.policy.cache
        if not settings.enabled:
            return None
        if bypasses_lookup(_headers(headers)):
            self.counts["bypass"] += 1
            return None
        if keys is None:
            request = request_json if model is None else {**request_json, "model": model}
            if not cacheable(tenant, request, self.policy):
                self.counts["uncacheable"] += 1
                return None
            keys = cache_keys(tenant, request, self.policy)
        hit = await self._exact(keys) if settings.exact.enabled else None
        if hit is None and settings.semantic.enabled and keys.question is not None:
            hit = await self._semantic(keys)
        self.counts[hit.kind if hit else "miss"] += 1
        return hit

    async def _exact(self, keys: CacheKeys) -> Hit | None:
        entry = await self.exact.get(ExactKey(keys.exact, keys.namespace, keys.model), self.clock())
        return Hit("exact", entry, keys.exact) if entry is not None else None

    async def _semantic(self, keys: CacheKeys) -> Hit | None:
        assert keys.question is not None
        if self.semantic.index.namespace(keys.semantic_namespace) is None:
            return None  # nothing to compare with: no embedding on the request path
        vector = await self.semantic.vector(keys.question)
        if vector is None:
            return None
        self._remember(keys.exact, vector)
        found = await self.semantic.find(keys, vector, self.clock())
        if isinstance(found, SemanticMatch):
            return Hit("semantic", found.item.entry, keys.exact, found.score)
        return None

    def _remember(self, key: str, vector: np.ndarray) -> None:
        """Keep a miss's vector so that storing its answer need not embed again."""
        self._vectors[key] = vector
        while len(self._vectors) > MAX_REMEMBERED_VECTORS:
            self._vectors.popitem(last=False)

    async def store(self, tenant: str, model: str | None, request_json: Mapping[str, Any],
                    answer: CacheEntry | Mapping[str, Any],
                    headers: HeadersLike | None = None, *,
                    keys: CacheKeys | None = None) -> bool:
        """``keys``: as for ``lookup`` (the request's own, found cacheable then)."""
        settings = self.policy.cache
        if not settings.enabled or forbids_store(_headers(headers)):
            return False
        if keys is None:
            request = request_json if model is None else {**request_json, "model": model}
            if not cacheable(tenant, request, self.policy):
                return False
            keys = cache_keys(tenant, request, self.policy)
        entry = answer if isinstance(answer, CacheEntry) else entry_from_response(dict(answer))
        if entry is None:
            return False
        now = self.clock()
        if settings.exact.enabled:
            await self.exact.put(ExactKey(keys.exact, keys.namespace, keys.model), entry, now)
        if settings.semantic.enabled and keys.question is not None:
            vector = self._vectors.pop(keys.exact, None)
            if vector is None:
                with anyio.move_on_after(STORE_EMBED_TIMEOUT_S):
                    vector = await self.semantic.vector(keys.question)
            if vector is not None:
                await self.semantic.add(keys, vector, entry, now)
        self.counts["stored"] += 1
        return True

    # -- administration --------------------------------------------------

    async def purge(self, tenant: str | None = None, model: str | None = None,
                    key: str | None = None) -> int:
        """Remove matching entries (model: canonical name); how many were removed here."""
        if model is not None:
            model = self.policy.canonical_model(model)
        exact = await self.exact.purge(tenant, model, key)
        semantic = await self.semantic.purge(Purge(tenant, model, key))
        return exact + semantic

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts,
            "exact_entries": len(self.exact.local.lru),
            "exact_bytes": self.exact.local.lru.bytes,
            "exact_evictions": self.exact.local.lru.evictions,
            "semantic_entries": len(self.semantic.index),
            "semantic_evictions": self.semantic.index.evictions,
            "semantic_synced": self.semantic.synced,
            "guard_rejections": dict(self.semantic.guard_rejections),
            "semantic_judge": self.semantic.settings.judge,
            "redis_timeouts": self.guard.timeouts,
            "redis_errors": self.guard.errors,
            "redis_skipped": self.guard.skipped,
            "redis_sync_faults": self.semantic.sync_faults,
            "embedder": self._embedder_stats(),
        }

    def _embedder_stats(self) -> dict[str, int]:
        """The embedder's health: its (sidecar) starts, and embeds refused (not
        ready, queue full) or lost with a dead child; each of those was a miss.
        Nothing while the policy leaves the semantic cache off (the default): an
        embedder nobody started is not down (no HedgerowEmbedderDown)."""
        if not self.wants_embedder():
            return {}
        embedder = self.embedder
        return {"ready": int(bool(getattr(embedder, "ready", True))),
                "starts": int(getattr(embedder, "starts", 0)),
                "refused": int(getattr(embedder, "refused", 0)),
                "lost": int(getattr(embedder, "lost", 0)),
                "judge_failures": int(getattr(embedder, "judge_failures", 0))}
