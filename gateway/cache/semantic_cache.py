"""The semantic cache's I/O: embedding, and persistence through a Redis stream.

Every entry a gateway adds (vector, question, answer, namespaces, expiry) and
every purge (exact ones too, so other gateways drop what they copied into
memory) is appended to one Redis stream, ``hedgerow:cache:semantic:log``
(trimmed to about ``MAX_LOG`` records). ``SemanticCache.run`` reads the
stream from its start (rebuilding the index of a gateway that just started)
and then follows it, so each gateway's index converges on what all of them
added; a gateway skips its own records, which it applied when it made them.

Redis faults never fail a request: a write that fails is kept in a bounded
backlog and appended when Redis answers again; the follower retries after
``retry_after_s`` from where it stopped. If Redis lost the stream (restarted
without persistence), entries known locally stay usable until they expire.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import anyio
import numpy as np
from anyio.abc import TaskStatus
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.cache.embedder import Embedder, EmbedderBusy, PairJudge
from gateway.cache.entry import CacheEntry, EntryDecodeError
from gateway.cache.keys import CacheKeys
from gateway.cache.semantic import (
    ItemIds,
    SemanticIndex,
    SemanticItem,
    SemanticMatch,
    SemanticMiss,
    build_index,
    choose,
    same_wording,
)
from gateway.cache.store import Guarded, Purge
from policies.schema import SemanticCache as SemanticPolicy

log = logging.getLogger("hedgerow.cache")

STREAM = "hedgerow:cache:semantic:log"
MAX_LOG = 100_000
READ_COUNT = 1000
BLOCK_MS = 1000
MAX_BACKLOG = 1000

Fields = Mapping[bytes | str, bytes | str]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def item_fields(item: SemanticItem) -> dict[str, bytes | str]:
    return {"op": "add", "id": item.item_id, "ns": item.namespace, "cns": item.cache_namespace,
            "model": item.model, "key": item.key, "q": item.question,
            "v": item.vector.astype(np.float32).tobytes(), "e": item.entry.encode(),
            "exp": repr(item.expires)}


def purge_fields(what: Purge, origin: str) -> dict[str, bytes | str]:
    return {"op": "purge", "id": origin, "tenant": what.tenant or "", "model": what.model or "",
            "key": what.key or ""}


def record_from_fields(raw: Fields, dim: int) -> SemanticItem | Purge | None:
    """The item or purge a stream record holds; None if it is unreadable."""
    fields = {_text(k): v for k, v in raw.items()}
    try:
        op = _text(fields["op"])
        if op == "purge":
            return Purge(_text(fields["tenant"]) or None, _text(fields["model"]) or None,
                         _text(fields["key"]) or None)
        data = fields["v"]
        vector = np.frombuffer(data if isinstance(data, bytes) else data.encode("latin-1"),
                               dtype=np.float32)
        if op != "add" or vector.shape != (dim,):
            return None
        entry = fields["e"]
        return SemanticItem(
            _text(fields["id"]), _text(fields["ns"]), _text(fields["cns"]),
            _text(fields["model"]), _text(fields["key"]), _text(fields["q"]), vector.copy(),
            CacheEntry.decode(entry if isinstance(entry, bytes) else entry.encode()),
            float(_text(fields["exp"])))
    except (KeyError, ValueError, EntryDecodeError):
        return None


_SHIPPED = SemanticPolicy()


@dataclass
class SemanticSettings:
    threshold: float  # judge "cosine": with the guards
    ttl_s: float
    embed_timeout_s: float = 0.25  # a slower embedding or judgement (queue under load) is a miss
    judge: str = _SHIPPED.judge  # "pair_model" or "cosine" (policies.schema.SemanticCache)
    pair_threshold: float = _SHIPPED.pair_threshold
    max_candidates: int = _SHIPPED.max_candidates
    candidate_floor: float = _SHIPPED.candidate_floor

    @classmethod
    def of(cls, semantic: SemanticPolicy) -> SemanticSettings:
        return cls(semantic.threshold, semantic.ttl_s, judge=semantic.judge,
                   pair_threshold=semantic.pair_threshold,
                   max_candidates=semantic.max_candidates,
                   candidate_floor=semantic.candidate_floor)


class SemanticCache:
    def __init__(self, index: SemanticIndex, embedder: Embedder, settings: SemanticSettings,
                 redis: Redis | None, guard: Guarded, *, origin: str | None = None,
                 on_remote_purge: Callable[[Purge], object] | None = None,
                 judge: PairJudge | None = None) -> None:
        self.index = index
        self.embedder = embedder
        if judge is None and hasattr(embedder, "judge"):  # the sidecar embeds and judges
            judge = cast(PairJudge, embedder)
        self.judge = judge  # None: no judge, so judge "pair_model" lookups miss
        self.settings = settings
        self.redis = redis
        self.guard = guard
        self.on_remote_purge = on_remote_purge  # e.g. the exact cache's local memory
        self.ids = ItemIds(origin or uuid.uuid4().hex[:12])
        self._backlog: deque[dict[str, bytes | str]] = deque(maxlen=MAX_BACKLOG)
        self._last_id = "0-0"
        self.synced = 0  # records applied from other gateways
        self.sync_faults = 0
        self.guard_rejections: dict[str, int] = {}
        self.rebuilds = 0
        self._rebuild_wanted: anyio.Event | None = None  # made by run(), on the loop

    @property
    def origin(self) -> str:
        return self.ids.origin

    async def vector(self, question: str) -> np.ndarray | None:
        """The question's embedding, or None (embedder busy, slow or not loaded)."""
        with anyio.move_on_after(self.settings.embed_timeout_s):
            try:
                return await self.embedder.embed(question)
            except EmbedderBusy:
                return None
        return None

    async def find(self, keys: CacheKeys, vector: np.ndarray,
                   now: float) -> SemanticMatch | SemanticMiss:
        """The cached answer to reuse for ``keys.question``, as the policy's judge decides."""
        assert keys.question is not None
        settings = self.settings
        if settings.judge == "cosine":
            found = self.index.search(keys.semantic_namespace, vector, settings.threshold,
                                      keys.question, now)
        else:
            found = await self._judged(keys, vector, now)
        if isinstance(found, SemanticMiss) and found.rejected_by:
            reason = found.rejected_by
            self.guard_rejections[reason] = self.guard_rejections.get(reason, 0) + 1
        return found

    async def _judged(self, keys: CacheKeys, vector: np.ndarray,
                      now: float) -> SemanticMatch | SemanticMiss:
        assert keys.question is not None
        settings = self.settings
        candidates = self.index.candidates(keys.semantic_namespace, vector,
                                           settings.candidate_floor, settings.max_candidates, now)
        if not candidates:
            return SemanticMiss(-1.0, None)
        found: SemanticMatch | SemanticMiss | None = same_wording(candidates, keys.question)
        if found is None:
            scores = await self._scores(keys.question, [c.item.question for c in candidates])
            if scores is None:
                return SemanticMiss(candidates[0].score, None)
            found = choose(candidates, scores.tolist(), settings.pair_threshold)
        if isinstance(found, SemanticMatch) and not self.index.used(found):
            # Purged or evicted while the judge read it: a purge that has returned
            # must not be followed by its answer.
            return SemanticMiss(candidates[0].score, None)
        return found

    async def _scores(self, question: str, cached: list[str]) -> np.ndarray | None:
        """The judge's scores, or None (no judge, busy, slow: a miss)."""
        if self.judge is None:
            return None
        with anyio.move_on_after(self.settings.embed_timeout_s):
            try:
                return await self.judge.judge(question, cached)
            except EmbedderBusy:
                return None
        return None

    async def add(self, keys: CacheKeys, vector: np.ndarray, entry: CacheEntry, now: float) -> None:
        assert keys.question is not None
        item = SemanticItem(self.ids(), keys.semantic_namespace, keys.namespace, keys.model,
                            keys.exact, keys.question, vector, entry, now + self.settings.ttl_s)
        self.index.add(item, now)
        self._added()
        await self._append(item_fields(item))

    async def purge(self, what: Purge) -> int:
        removed = self.index.purge(what)
        await self._append(purge_fields(what, self.origin))
        return removed

    async def _append(self, fields: dict[str, bytes | str]) -> None:
        if self.redis is None:
            return
        redis = self.redis

        async def append() -> bool:
            await redis.xadd(STREAM, cast(Any, fields), maxlen=MAX_LOG, approximate=True)
            return True

        if not await self.guard.call(append, False):
            self._backlog.append(fields)

    # -- the follower ----------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Index rebuilds on a thread, and (with Redis) the stream follower; started
        once the index is rebuilt from the stream (or Redis is found down)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._rebuild_indexes)
            if self.redis is not None:
                await tg.start(self._follow)
            task_status.started()

    async def _rebuild_indexes(self) -> None:
        """Build wanted indexes (HNSW: seconds for thousands of entries) off the loop."""
        while True:
            self._rebuild_wanted = anyio.Event()
            if not self.index.rebuilds_wanted():
                await self._rebuild_wanted.wait()
            for name in self.index.rebuilds_wanted():
                space = self.index.namespace(name)
                if space is None:
                    continue
                snapshot = space.snapshot()
                built = await anyio.to_thread.run_sync(
                    build_index, self.index.dim, snapshot.hnsw, snapshot.vectors)
                if self.index.namespace(name) is space:  # not evicted meanwhile
                    space.install(snapshot, built)
                    self.rebuilds += 1

    def _added(self) -> None:
        if self._rebuild_wanted is not None and self.index.rebuilds_wanted():
            self._rebuild_wanted.set()

    async def _follow(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self.redis is not None
        started = False
        while True:
            try:
                await self._flush_backlog()
                caught_up = await self._read_once(block=started)
            except (RedisError, OSError, TimeoutError) as error:
                self.sync_faults += 1
                log.warning("semantic cache sync: Redis fault (%s); retrying in %.1f s",
                            error, self.guard.circuit.retry_after_s)
                caught_up = True
                if started:
                    await anyio.sleep(self.guard.circuit.retry_after_s)
            if caught_up and not started:
                started = True
                task_status.started()

    async def _read_once(self, *, block: bool) -> bool:
        assert self.redis is not None
        replies = await self.redis.xread({STREAM: self._last_id}, count=READ_COUNT,
                                         block=BLOCK_MS if block else None)
        records = replies[0][1] if replies else []
        now = self.guard.clock()
        for record_id, raw in records:
            self._last_id = _text(record_id)
            if not self._ours(raw):  # ours were applied when made, in order
                self._apply(record_from_fields(raw, self.index.dim), now)
        self._added()
        return len(records) < READ_COUNT

    def _ours(self, raw: Fields) -> bool:
        made_by = _text(raw.get(b"id", raw.get("id", b"")))
        return made_by == self.origin or made_by.startswith(self.origin + "-")

    def _apply(self, record: SemanticItem | Purge | None, now: float) -> None:
        if record is None:
            return
        if isinstance(record, Purge):
            self.index.purge(record)
            if self.on_remote_purge is not None:
                self.on_remote_purge(record)
        else:
            self.index.add(record, now)
        self.synced += 1

    async def _flush_backlog(self) -> None:
        if not self._backlog or self.redis is None:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for fields in self._backlog:
                pipe.xadd(STREAM, cast(Any, fields), maxlen=MAX_LOG, approximate=True)
            await pipe.execute()
        log.info("semantic cache: appended %d entries kept while Redis was away",
                 len(self._backlog))
        self._backlog.clear()
