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
    key: float
    item: T


class EdfQueue(Generic[T]):
    """A bounded earliest-deadline-first queue with cancellation by handle.

    Items are served in ``key`` order (by default their deadline) and expire at
    their ``deadline``. A separate key lets a class be *served* by its first-
    token due time while it may still *wait* until a later hard deadline.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity!r}")
        self.capacity = capacity
        self._seq = itertools.count()
        # Two lazy heaps over the same live entries: service order and expiry.
        # Entries that left (popped, expired, cancelled) are dropped from a heap
        # when they reach its top, or by a compaction.
        self._order: list[tuple[float, int]] = []
        self._expiry: list[tuple[float, int]] = []
        self._live: dict[int, _Entry[T]] = {}
        # Expired but not yet handed out by ``expire``: never popped again
        # (``now`` never decreases).
        self._overdue: set[int] = set()

    def __len__(self) -> int:
        """Items pushed and not yet popped, expired or cancelled."""
        return len(self._live)

    def push(self, item: T, deadline: float, now: float, *, key: float | None = None) -> EdfHandle | None:
        """Queue ``item``; return its handle, or ``None`` (nothing queued) when full.

        ``key`` orders service (default: ``deadline``). An item pushed already
        past its deadline is accepted and comes back from the next ``expire``.
        """
        order = deadline if key is None else key
        if deadline != deadline or order != order:
            raise ValueError("a deadline or key cannot be NaN")
        if len(self._live) >= self.capacity:
            return None
        handle = EdfHandle(next(self._seq))
        self._live[handle.seq] = _Entry(deadline, order, item)
        heapq.heappush(self._order, (order, handle.seq))
        heapq.heappush(self._expiry, (deadline, handle.seq))
        return handle

    def pop(self, now: float) -> T | None:
        """Remove and return the first item in key order not expired at ``now``.

        Expired items are not lost: they are set aside for the next ``expire``.
        """
        self._set_aside_overdue(now)
        self._drop_gone(self._order)
        if not self._order:
            return None
        _, seq = heapq.heappop(self._order)
        return self._live.pop(seq).item

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
        self._overdue.discard(handle.seq)
        if len(self._order) > 2 * self.capacity:
            self._compact()
        return True

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued items, or None when empty."""
        deadlines = [self._live[seq].deadline for seq in self._overdue if seq in self._live]
        self._drop_gone(self._expiry)
        if self._expiry:
            deadlines.append(self._expiry[0][0])
        return min(deadlines, default=None)

    def count_ahead(self, key: float) -> int:
        """How many queued items an item pushed now with ``key`` would wait behind.

        Equal keys count as ahead (FIFO). This is what a wait prediction for an
        EDF queue should use, not ``len``.
        """
        return sum(1 for seq, entry in self._live.items()
                   if entry.key <= key and seq not in self._overdue)

    def _set_aside_overdue(self, now: float) -> None:
        self._drop_gone(self._expiry)
        while self._expiry and self._expiry[0][0] <= now:
            self._overdue.add(heapq.heappop(self._expiry)[1])
            self._drop_gone(self._expiry)

    def _drop_gone(self, heap: list[tuple[float, int]]) -> None:
        """Pop entries that left the queue or are set aside as overdue."""
        while heap and (heap[0][1] not in self._live or heap[0][1] in self._overdue):
            heapq.heappop(heap)

    def _compact(self) -> None:
        self._order = [(e.key, seq) for seq, e in self._live.items() if seq not in self._overdue]
        self._expiry = [(e.deadline, seq) for seq, e in self._live.items()
                        if seq not in self._overdue]
        heapq.heapify(self._order)
        heapq.heapify(self._expiry)
