"""The semantic cache: similar questions in the same context share an answer.

Questions are grouped by namespace (tenant, model, parameters, system prompt
and earlier turns: ``CacheKeys.semantic_namespace``), so a different context
never collides. Each namespace has its own FAISS index over unit vectors
(inner product = cosine): exact ``IndexFlatIP`` while small, ``IndexHNSWFlat``
once it holds more than ``hnsw_above`` entries. Entries are bounded per
namespace (least recently used evicted), namespaces are bounded too, and
every entry has a TTL. How a lookup decides depends on the policy's judge:

- ``pair_model`` (the default): the ``candidates`` nearest the question (at
  most ``max_candidates``, cosine at least ``candidate_floor``) are read
  together with it by the pair model (``gateway.cache.pair_model``, in the
  sidecar); ``choose`` takes the one it scores highest if that reaches
  ``pair_threshold``. The guards are not applied: on top of the pair model
  they cost recall and bought no precision (docs/benchmarks.md). First, a
  candidate typed as the question is (``typing_key``: whitespace, one closing
  mark, the first capital) is the hit without the model, which scores such
  near-copies low.
- ``cosine``: a hit when a candidate's cosine reaches ``threshold`` AND the
  guards (``guards.compare``) agree (``search``).

``SemanticIndex`` is synchronous and takes ``now``; the I/O (embedding,
Redis, HNSW builds on a thread) is in ``semantic_cache.py``.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

import faiss
import numpy as np

from gateway.cache import guards
from gateway.cache.entry import CacheEntry
from gateway.cache.store import Purge

# One query at a time, on the event loop: OpenMP worker threads only spin
# against the gateway for the cores (2 here) and never speed one query up.
faiss.omp_set_num_threads(1)

SEARCH_K = 8
HNSW_M = 32
HNSW_EF_SEARCH = 64


@dataclass(frozen=True)
class SemanticItem:
    """One cached question and its answer."""

    item_id: str  # unique across gateways (origin + sequence)
    namespace: str  # semantic namespace digest
    cache_namespace: str  # "tenant:NAME" / "shared:NAME", for purges
    model: str
    key: str  # the exact key of the request that produced it
    question: str
    vector: np.ndarray
    entry: CacheEntry
    expires: float  # wall clock: entries travel between gateways

    def matches(self, what: Purge) -> bool:
        return ((what.tenant is None or self.cache_namespace == f"tenant:{what.tenant}")
                and (what.model is None or self.model == what.model)
                and (what.key is None or self.key == what.key))


@dataclass(frozen=True)
class SemanticMatch:
    item: SemanticItem
    score: float


@dataclass(frozen=True)
class SemanticMiss:
    best_score: float  # -1 when the namespace is empty
    # What refused a candidate: a guard's name, or JUDGE_REFUSED (the pair model).
    rejected_by: str | None


JUDGE_REFUSED = "pair_model"


_SPACES = re.compile(r"\s+")


def typing_key(question: str) -> str | None:
    """A question as typing varies it without changing what it asks: runs of
    whitespace, one closing ``?`` or ``.`` after a letter, and the sentence's
    first capital when a lower-case letter follows it ("How" / "how"). Nothing
    else: case inside the text can be meaning ("50 MB/s" vs "50 Mb/s"), so can
    a capital before a space or capital ("G" vs "g", "US" vs "uS"), a "!"
    ("10!") and marks after a digit, space or mark ("cd .."). None when no
    letter or digit is left to compare. Linear in the text (no backtracking
    pattern: a question can be 256 KiB)."""
    text = _SPACES.sub(" ", question).strip()
    if len(text) >= 2 and text[-1] in "?." and text[-2].isalpha():
        text = text[:-1]
    if len(text) >= 2 and text[0].isupper() and text[1].islower():
        text = text[0].lower() + text[1:]
    return text if any(c.isalnum() for c in text) else None


def typed_alike(one: str, other: str) -> bool:
    key = typing_key(one)
    return key is not None and key == typing_key(other)


def same_wording(candidates: Sequence[SemanticMatch], question: str) -> SemanticMatch | None:
    """The candidate whose ``typing_key`` is the question's, as a match of score
    1.0, without the pair model: the model, trained on pairs that change one fact
    in otherwise identical words, scores such near-copies low (a question without
    its "?" scored 0.005 against itself with it; docs/benchmarks.md). Such a hit
    does not depend on ``pair_threshold``."""
    asked = typing_key(question)
    if asked is None:
        return None
    for candidate in candidates:
        if typing_key(candidate.item.question) == asked:
            return SemanticMatch(candidate.item, 1.0)
    return None


def choose(candidates: Sequence[SemanticMatch], scores: Sequence[float],
           threshold: float) -> SemanticMatch | SemanticMiss:
    """The candidate the pair model scored highest, if it reaches ``threshold``;
    its match carries that score. ``candidates`` come best cosine first."""
    if not candidates:
        return SemanticMiss(-1.0, None)
    best = max(range(len(candidates)), key=lambda i: scores[i])
    if scores[best] >= threshold:
        return SemanticMatch(candidates[best].item, float(scores[best]))
    return SemanticMiss(candidates[0].score, JUDGE_REFUSED)


def build_index(dim: int, hnsw: bool, vectors: list[np.ndarray]) -> faiss.Index:
    """A new FAISS index over ``vectors`` (pure: safe to run on a worker thread)."""
    index: faiss.Index
    if hnsw:
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = HNSW_EF_SEARCH
    else:
        index = faiss.IndexFlatIP(dim)
    if vectors:
        index.add(np.stack(vectors))
    return index


@dataclass(frozen=True)
class IndexSnapshot:
    """What a rebuild needs, taken on the event loop; built on a thread."""

    hnsw: bool
    ids: list[str]
    vectors: list[np.ndarray]


class NamespaceIndex:
    """One namespace's entries and their FAISS index (flat, then HNSW).

    Removed entries stay in the index as dead rows (HNSW cannot delete) until
    a rebuild. Rebuilding a flat index is cheap and done at once; building an
    HNSW index takes seconds for thousands of entries, so it is only asked for
    (``rebuild_wanted``) and done off the event loop: ``snapshot()`` →
    ``build_index`` on a thread → ``install()``, which adds the entries that
    arrived meanwhile.
    """

    def __init__(self, dim: int, hnsw_above: int) -> None:
        self.dim = dim
        self.hnsw_above = hnsw_above
        self.items: OrderedDict[str, SemanticItem] = OrderedDict()  # LRU order
        self._facts: dict[str, guards.Facts] = {}
        self._positions: list[str] = []  # index row -> item id (dead if not in items)
        self._index: faiss.Index = faiss.IndexFlatIP(dim)
        self.hnsw = False

    def __len__(self) -> int:
        return len(self.items)

    @property
    def rebuild_wanted(self) -> bool:
        grow = not self.hnsw and len(self.items) > self.hnsw_above
        return grow or len(self._positions) > 2 * len(self.items) + 16

    def add(self, item: SemanticItem) -> None:
        if item.item_id in self.items:
            return
        self.items[item.item_id] = item
        self._facts[item.item_id] = guards.facts(item.question)
        self._index.add(item.vector.reshape(1, -1))
        self._positions.append(item.item_id)

    def remove(self, item_id: str) -> None:
        self.items.pop(item_id, None)
        self._facts.pop(item_id, None)

    def oldest(self) -> str:
        return next(iter(self.items))

    def compact_if_cheap(self) -> None:
        """Rebuild now if the result is a flat index (milliseconds)."""
        if self.rebuild_wanted and len(self.items) <= self.hnsw_above:
            snapshot = self.snapshot()
            self.install(snapshot, build_index(self.dim, False, snapshot.vectors))

    def snapshot(self) -> IndexSnapshot:
        ids = list(self.items)
        return IndexSnapshot(len(ids) > self.hnsw_above, ids,
                             [self.items[i].vector for i in ids])

    def install(self, snapshot: IndexSnapshot, index: faiss.Index) -> None:
        known = set(snapshot.ids)
        self._index, self._positions, self.hnsw = index, list(snapshot.ids), snapshot.hnsw
        for item_id, item in self.items.items():
            if item_id not in known:  # arrived while the index was being built
                self._index.add(item.vector.reshape(1, -1))
                self._positions.append(item_id)

    def nearest(self, vector: np.ndarray, now: float) -> list[SemanticMatch]:
        """Up to SEARCH_K live entries by cosine, best first (expired ones removed)."""
        if not self.items:
            return []
        k = min(SEARCH_K, len(self._positions))
        scores, rows = self._index.search(vector.reshape(1, -1), k)
        found = []
        for score, row in zip(scores[0].tolist(), rows[0].tolist()):
            item = self.items.get(self._positions[row]) if row >= 0 else None
            if item is None:
                continue
            if item.expires <= now:
                self.remove(item.item_id)
                continue
            found.append(SemanticMatch(item, score))
        return found

    def used(self, item: SemanticItem) -> bool:
        """A hit: the entry is the most recently used. False when it is gone."""
        if item.item_id not in self.items:
            return False
        self.items.move_to_end(item.item_id)
        return True

    def search(self, vector: np.ndarray, threshold: float, question: guards.Facts,
               now: float) -> SemanticMatch | SemanticMiss:
        """The cosine judge: the first candidate at or above ``threshold`` that the guards pass."""
        best, rejected = -1.0, None
        for candidate in self.nearest(vector, now):
            best = max(best, candidate.score)
            if candidate.score < threshold:
                break  # results come best first
            reason = guards.compare(question, self._facts[candidate.item.item_id])
            if reason is None:
                self.used(candidate.item)
                return candidate
            rejected = rejected or reason
        return SemanticMiss(best, rejected)


class SemanticIndex:
    """All namespaces, bounded: entries per namespace and namespaces overall (LRU)."""

    def __init__(self, dim: int, *, max_entries_per_namespace: int, max_namespaces: int,
                 hnsw_above: int) -> None:
        self.dim = dim
        self.max_entries = max_entries_per_namespace
        self.max_namespaces = max_namespaces
        self.hnsw_above = hnsw_above
        self._namespaces: OrderedDict[str, NamespaceIndex] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return sum(len(ns) for ns in self._namespaces.values())

    def namespace(self, name: str) -> NamespaceIndex | None:
        return self._namespaces.get(name)

    def add(self, item: SemanticItem, now: float) -> None:
        if item.expires <= now:
            return
        space = self._namespaces.get(item.namespace)
        if space is None:
            space = self._namespaces[item.namespace] = NamespaceIndex(self.dim, self.hnsw_above)
            while len(self._namespaces) > self.max_namespaces:
                _, evicted = self._namespaces.popitem(last=False)
                self.evictions += len(evicted)
        self._namespaces.move_to_end(item.namespace)
        space.add(item)
        while len(space) > self.max_entries:
            space.remove(space.oldest())
            self.evictions += 1
        space.compact_if_cheap()

    def rebuilds_wanted(self) -> list[str]:
        """Namespaces whose index should be rebuilt (off the event loop)."""
        return [name for name, space in self._namespaces.items() if space.rebuild_wanted]

    def rebuild_now(self, name: str) -> None:
        """Rebuild one namespace's index inline (tests, tools; the cache uses a thread)."""
        space = self._namespaces.get(name)
        if space is not None:
            snapshot = space.snapshot()
            space.install(snapshot, build_index(self.dim, snapshot.hnsw, snapshot.vectors))

    def search(self, namespace: str, vector: np.ndarray, threshold: float, question: str,
               now: float) -> SemanticMatch | SemanticMiss:
        space = self._namespaces.get(namespace)
        if space is None:
            return SemanticMiss(-1.0, None)
        self._namespaces.move_to_end(namespace)
        return space.search(vector, threshold, guards.facts(question), now)

    def candidates(self, namespace: str, vector: np.ndarray, floor: float, limit: int,
                   now: float) -> list[SemanticMatch]:
        """For the pair model: the ``limit`` nearest live entries with cosine >= ``floor``."""
        space = self._namespaces.get(namespace)
        if space is None:
            return []
        self._namespaces.move_to_end(namespace)
        return [c for c in space.nearest(vector, now) if c.score >= floor][:limit]

    def used(self, match: SemanticMatch) -> bool:
        """``match`` is served: most recently used. False when it left the index meanwhile."""
        space = self._namespaces.get(match.item.namespace)
        return space is not None and space.used(match.item)

    def purge(self, what: Purge) -> int:
        removed = 0
        for name in list(self._namespaces):
            space = self._namespaces[name]
            doomed = [i for i, item in space.items.items() if item.matches(what)]
            for item_id in doomed:
                space.remove(item_id)
            removed += len(doomed)
            if not space:
                del self._namespaces[name]
            else:
                space.compact_if_cheap()
        return removed

    def configure(self, *, max_entries_per_namespace: int, max_namespaces: int,
                  hnsw_above: int) -> None:
        self.max_entries = max_entries_per_namespace
        self.max_namespaces = max_namespaces
        self.hnsw_above = hnsw_above


class ItemIds:
    """Ids unique across gateways: this process's origin plus a sequence."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self._next = count()

    def __call__(self) -> str:
        return f"{self.origin}-{next(self._next)}"
