"""The per-model wait queue: earliest deadline first, bounded, and never runs the late (sans-IO).

When a worker slot frees, the request that must finish soonest goes next;
equal deadlines go first-in first-out. A lower class is never starved for
ever: its (later) deadline comes due and then it either runs or is shed.

A request whose deadline has passed is never handed out by ``pop``; ``expire``
returns such requests so the caller can shed them with a clear error. An item
is *expired* once ``now >= deadline``. Every pushed item leaves the queue
exactly once: by ``pop``, by ``expire`` or by ``cancel``.

``push`` on a full queue returns ``None`` instead of a handle (a full queue is
an ordinary overload, not a bug); the caller refuses the request with 503.
Admission checks the bound first, so this is normally the backstop.

Drive it like a timer: ``next_deadline()`` is when the next item expires, so
the owning actor sleeps until then (or until a slot frees), calls
``expire(now)`` and sheds what it returns.

Plain FIFO (the benchmark's comparison) is this queue with every item pushed
at ``now + C`` for one constant ``C``: equal relative deadlines pop in
arrival order.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class EdfHandle:
    """Names one pushed item, for ``cancel``. Ordered by push time."""

    seq: int


@dataclass(frozen=True)
class _Entry(Generic[T]):
    deadline: float
    item: T


class EdfQueue(Generic[T]):
    """A bounded earliest-deadline-first queue with cancellation by handle."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity!r}")
        self.capacity = capacity
        self._seq = itertools.count()
        # Heap of (deadline, seq); the live entries are those still in _live.
        # Cancelled entries stay in the heap until they reach the top or a
        # compaction drops them.
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, _Entry[T]] = {}
        # Seqs of expired items taken off the heap by ``pop``, waiting for
        # ``expire`` to hand them out; once expired, always expired (``now``
        # never decreases).
        self._overdue: list[int] = []

    def __len__(self) -> int:
        """Items pushed and not yet popped, expired or cancelled."""
        return len(self._live)

    def push(self, item: T, deadline: float, now: float) -> EdfHandle | None:
        """Queue ``item``; return its handle, or ``None`` (nothing queued) when full.

        An item pushed already past its deadline is accepted and comes back from
        the next ``expire``; ``now`` is taken for symmetry with the other calls.
        """
        if deadline != deadline:
            raise ValueError("a deadline cannot be NaN")
        if len(self._live) >= self.capacity:
            return None
        handle = EdfHandle(next(self._seq))
        self._live[handle.seq] = _Entry(deadline, item)
        heapq.heappush(self._heap, (deadline, handle.seq))
        return handle

    def pop(self, now: float) -> T | None:
        """Remove and return the earliest-deadline item not expired at ``now``.

        Expired items are not lost: they are set aside for the next ``expire``.
        """
        self._set_aside_overdue(now)
        return self._take_top() if self._heap else None

    def expire(self, now: float) -> list[T]:
        """Remove and return, earliest deadline first, every item expired at ``now``."""
        self._set_aside_overdue(now)
        due = sorted((self._live[seq].deadline, seq) for seq in self._overdue if seq in self._live)
        self._overdue.clear()
        return [self._live.pop(seq).item for _, seq in due]

    def cancel(self, handle: EdfHandle) -> bool:
        """Remove the item behind ``handle`` (its client went away).

        Returns False when it had already left the queue (popped, expired or
        cancelled), so a late cancel is harmless.
        """
        if self._live.pop(handle.seq, None) is None:
            return False
        if len(self._heap) + len(self._overdue) > 2 * self.capacity:
            self._compact()
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued items, or None when empty."""
        self._drop_dead_top()
        deadlines = [self._live[seq].deadline for seq in self._overdue if seq in self._live]
        if self._heap:
            deadlines.append(self._heap[0][0])
        return min(deadlines, default=None)

    def count_ahead(self, deadline: float) -> int:
        """How many queued items an item pushed now with ``deadline`` would wait behind.

        Equal deadlines count as ahead (FIFO). This is what a wait prediction
        for an EDF queue should use, not ``len``.
        """
        return sum(1 for entry in self._live.values() if entry.deadline <= deadline)

    def _set_aside_overdue(self, now: float) -> None:
        self._drop_dead_top()
        while self._heap and self._heap[0][0] <= now:
            self._overdue.append(heapq.heappop(self._heap)[1])
            self._drop_dead_top()

    def _take_top(self) -> T:
        _, seq = heapq.heappop(self._heap)
        return self._live.pop(seq).item

    def _drop_dead_top(self) -> None:
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)

    def _compact(self) -> None:
        self._overdue = [seq for seq in self._overdue if seq in self._live]
        overdue = set(self._overdue)
        self._heap = [(e.deadline, seq) for seq, e in self._live.items() if seq not in overdue]
        heapq.heapify(self._heap)
