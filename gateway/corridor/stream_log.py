"""The events of one streamed completion, kept so clients can follow and resume it.

A generation appends its SSE events to a ``StreamLog``; every client reading
the stream (the one that asked, one that reconnected with ``Last-Event-ID``,
or an identical request sharing the generation) follows the log at its own
pace. So the generation never waits for a slow reader, a reader never makes
the gateway buffer without bound (the log keeps at most ``max_bytes`` of
events and a reader that falls behind them gets an error), and a client that
lost its connection can pick up after the last event it saw.

Event ids are 1, 2, 3 … in order; ``after=0`` means from the beginning.

    opening ──► open ──► (events …) ──► finished
       └──► refused (an error before the first token: the client gets an
            HTTP error, never a stream)

Waiting costs one bare future per wake-up, made only when a reader waits,
and whoever stops the generation does so by moving its cancel scope's
deadline (``stop_when_abandoned``), not with a task that watches readers.

``StreamBook`` is the gateway's bounded index of logs by request id, with
time injected: finished logs stay resumable for ``retain_s``, then go.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, NamedTuple

import anyio

from hedgerow.errors import StreamGone, StreamNotFound

EventKind = Literal["token", "usage", "done", "error", "other"]


class LogEvent(NamedTuple):  # a tuple: one is made per relayed token
    id: int
    kind: EventKind
    payload: bytes  # the whole SSE event, ``id:`` line included
    received: float  # monotonic time the gateway got it from the worker


class ReaderOverrun(Exception):
    """A reader fell behind the events the log still holds."""


@dataclass(frozen=True)
class Refusal:
    """Why the stream never started: an error to answer with instead."""

    error: BaseException


class StreamLog:
    def __init__(self, request_id: str, tenant: str, max_bytes: int,
                 include_usage: bool = False) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.max_bytes = max_bytes
        # The asking client's stream_options.include_usage, for those who resume it.
        self.include_usage = include_usage
        self.worker_id = ""
        self.hedged = False
        self.refusal: Refusal | None = None
        self._started = False
        self.finished = False
        self.finished_at = math.inf
        self.bytes = 0
        self.readers = 0
        # Set by whoever stops the generation early, for the stream's last event
        # (its error message, code and type: the drain's cut says gateway_draining).
        self.cancel_reason: str | None = None
        self.cancel_code = "stream_cancelled"
        self.cancel_type = "upstream_error"
        self._events: deque[LogEvent] = deque()
        # The book that indexes this log, told of its size and its end (None: in none).
        self._ledger: _Ledger | None = None
        self._next_id = 1
        self._opened = asyncio.Event()  # asyncio's own: see ``tickets._Assignment``
        # Futures of readers waiting for the next change, resolved (and
        # dropped) by it: the many appends nobody waits for allocate nothing.
        self._waiters: list[asyncio.Future[None]] = []
        # The generation's scope, stopped when nobody reads (``stop_when_abandoned``).
        self._generating: anyio.CancelScope | None = None
        self._grace_s = 0.0

    # -- the generation's side ------------------------------------------------

    def open(self, worker_id: str, hedged: bool) -> None:
        """The first token is here (``worker_id`` empty: a cache replay): readers
        may start their responses."""
        self.worker_id, self.hedged = worker_id, hedged
        self._started = True
        self._opened.set()
        self._steer()

    def refuse(self, error: BaseException) -> None:
        """The stream will never start; readers answer with ``error``. (The
        generation then calls ``finish``, which starts its retention clock.)"""
        self.refusal = Refusal(error)
        self._opened.set()
        self._wake()

    def append(self, kind: EventKind, data: bytes, received: float) -> LogEvent:
        """Add one event (``data`` is its ``data: …`` line(s), blank line included)."""
        event_id = self._next_id
        self._next_id += 1
        event = LogEvent(event_id, kind, b"id: %d\n" % event_id + data, received)
        self._events.append(event)
        before = self.bytes
        self.bytes += len(event.payload)
        while self.bytes > self.max_bytes and len(self._events) > 1:
            self.bytes -= len(self._events.popleft().payload)
        if self._ledger is not None:
            self._ledger.bytes += self.bytes - before
        self._wake()
        return event

    def finish(self, now: float) -> None:
        if not self.finished:
            self.finished = True
            self.finished_at = now
            if self._ledger is not None:
                self._ledger.finished(self)
            self._opened.set()  # a generation cancelled before its first token
            self._wake()

    def cancel(self, reason: str, *, code: str = "stream_cancelled",
               error_type: str = "upstream_error") -> None:
        """Ask the generation to stop; readers get an error event with ``reason``
        and ``code``. The first reason given is the one the stream ends with."""
        if not self.finished and self.cancel_reason is None:
            self.cancel_reason = reason
            self.cancel_code, self.cancel_type = code, error_type
            self._steer()

    # -- the readers' side ----------------------------------------------------

    @property
    def started(self) -> bool:
        return self._started

    @property
    def last_id(self) -> int:
        return self._next_id - 1

    async def wait_open(self) -> None:
        await self._opened.wait()

    def events_after(self, after: int) -> list[LogEvent]:
        """The events with ids above ``after``; ReaderOverrun when some were dropped."""
        if after >= self.last_id:
            return []
        first = self._events[0].id if self._events else self._next_id
        if after + 1 < first:
            raise ReaderOverrun(f"events {after + 1}..{first - 1} are no longer kept")
        # The newest ``last_id - after`` events, taken from the right end: a
        # reader keeping up costs what it reads, not the length of the log.
        newest = list(itertools.islice(reversed(self._events), self.last_id - after))
        newest.reverse()
        return newest

    def holds_after(self, after: int) -> bool:
        """Whether a resume from ``after`` can be served in full."""
        first = self._events[0].id if self._events else self._next_id
        return after + 1 >= first and after <= self.last_id

    async def wait_beyond(self, after: int, timeout_s: float) -> bool:
        """Wait until an event above ``after`` exists or the log finished; False on timeout."""
        with anyio.move_on_after(timeout_s):
            while after >= self.last_id and not self.finished:
                await self.next_change()
            return True
        return False

    def next_change(self) -> asyncio.Future[None]:
        """Resolved at the next event, the finish, or ``wake`` (await it)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Count one reader while the body runs (the generation waits for readers)."""
        self.readers += 1
        self._steer()
        try:
            yield
        finally:
            self.readers -= 1
            self._steer()

    def stop_when_abandoned(self, generating: anyio.CancelScope, grace_s: float) -> None:
        """Stop the generation running in ``generating`` once it should: cancelled,
        or nobody reading it for ``grace_s`` (at once if it never started, as its
        client never learnt its id). No task watches: each change of readers
        moves the scope's deadline (to never while someone reads)."""
        self._generating, self._grace_s = generating, grace_s
        self._steer()

    def _steer(self) -> None:
        scope = self._generating
        if scope is None or self.finished:
            return
        if self.cancel_reason is not None or (self.readers == 0 and not self._started):
            scope.cancel()
        elif self.readers == 0:
            if scope.deadline == math.inf:  # the grace starts when the last reader leaves
                scope.deadline = anyio.current_time() + self._grace_s
        elif scope.deadline != math.inf:
            scope.deadline = math.inf

    def wake(self) -> None:
        """Resolve every waiting reader's ``next_change`` (they look again)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    _wake = wake


class _Ledger:
    """What a ``StreamBook`` keeps current as its logs change, so that adding a
    log costs the same with ten thousand retained as with none: the bytes they
    hold, and a heap of finished logs by finish time (oldest expires first)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.expiring: list[tuple[float, int, StreamLog]] = []
        self._order = itertools.count()  # ties in the heap never compare logs

    def finished(self, log: StreamLog) -> None:
        heapq.heappush(self.expiring, (log.finished_at, next(self._order), log))


class StreamBook:
    """Logs by request id, bounded by count, total bytes and retention (time injected)."""

    def __init__(self, *, max_streams: int, max_total_bytes: int, retain_s: float) -> None:
        self.max_streams = max_streams
        self.max_total_bytes = max_total_bytes
        self.retain_s = retain_s
        # request id -> log; a request that joined another's generation has
        # its own id for the same log.
        self._logs: OrderedDict[str, tuple[str, StreamLog]] = OrderedDict()
        # Each log in the book -> the request ids it is kept under.
        self._ids: dict[StreamLog, list[str]] = {}
        # Request id -> when it was added (a counter), to drop in the order added.
        self._serial: dict[str, int] = {}
        self._next_serial = itertools.count()
        self._ledger = _Ledger()
        # Streams dropped for age or space, so a late resume hears 410, not 404.
        self._gone: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._logs)

    def configure(self, *, max_streams: int, max_total_bytes: int, retain_s: float) -> None:
        self.max_streams, self.max_total_bytes, self.retain_s = (
            max_streams, max_total_bytes, retain_s)

    def add(self, log: StreamLog, now: float) -> None:
        self.alias(log.request_id, log.tenant, log, now)

    def alias(self, request_id: str, tenant: str, log: StreamLog, now: float) -> None:
        """Make ``log`` resumable as ``request_id`` by ``tenant``."""
        self.expire(now)
        if request_id in self._logs:
            self._unlink(request_id)
        self._logs[request_id] = (tenant, log)
        self._serial[request_id] = next(self._next_serial)
        ids = self._ids.get(log)
        if ids is None:
            ids = self._ids[log] = []
            log._ledger = self._ledger
            self._ledger.bytes += log.bytes
            if log.finished and log.refusal is None:
                self._ledger.finished(log)
        ids.append(request_id)
        self._evict_finished(keep=log)

    def find(self, request_id: str, tenant: str, now: float) -> StreamLog:
        """The tenant's log for ``request_id``; 404 when unknown or another tenant's,
        410 when it expired."""
        self.expire(now)
        owner, log = self._logs.get(request_id, ("", None))
        if log is not None and owner == tenant:
            return log
        if log is None and self._gone.get(request_id) == tenant:
            raise StreamGone(f"stream {request_id!r} is no longer kept (finished too long ago)")
        raise StreamNotFound(f"no stream {request_id!r} to resume")

    def expire(self, now: float) -> None:
        """Drop the logs that finished more than ``retain_s`` ago (oldest first, from the heap)."""
        expiring = self._ledger.expiring
        expired: list[str] = []
        while expiring and now - expiring[0][0] > self.retain_s:
            _, _, log = heapq.heappop(expiring)
            expired.extend(self._ids.get(log, ()))
        # A log re-added after it left the book is in the heap twice: drop its ids once.
        for request_id in sorted(set(expired), key=self._serial.__getitem__):
            self._drop(request_id)

    def total_bytes(self) -> int:
        return self._ledger.bytes

    def _evict_finished(self, keep: StreamLog) -> None:
        """Oldest finished logs go first while over a bound; streams in flight stay."""
        while len(self._logs) > self.max_streams or self._ledger.bytes > self.max_total_bytes:
            oldest = next((request_id for request_id, (_, log) in self._logs.items()
                           if log is not keep and log.finished), None)
            if oldest is None:
                return
            self._drop(oldest)

    def _drop(self, request_id: str) -> None:
        tenant = self._unlink(request_id)
        self._gone[request_id] = tenant
        while len(self._gone) > self.max_streams:
            self._gone.popitem(last=False)

    def _unlink(self, request_id: str) -> str:
        """Forget ``request_id``; the log leaves the book with its last id. Its tenant."""
        tenant, log = self._logs.pop(request_id)
        del self._serial[request_id]
        ids = self._ids[log]
        ids.remove(request_id)
        if not ids:
            del self._ids[log]
            log._ledger = None
            self._ledger.bytes -= log.bytes
        return tenant
