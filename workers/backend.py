"""The seam between a worker's HTTP side and whatever produces tokens.

``Backend.generate(request)`` returns a ``GenerationStream``: an async
iterator of zero or more ``TokenChunk``s and then exactly one ``Finished``,
which must be closed — with ``aclose()``, ``contextlib.aclosing`` or
``async with`` — whether or not it was read to the end::

    async with backend.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenChunk):
                ...  # relay event.text
            else:
                ...  # event is Finished: finish_reason and usage

The first ``__anext__`` waits (FIFO) for a free slot; that wait is what
``BackendLoad.queued`` counts. Closing the stream for any reason — it ran
out, ``break``, an exception, the task being cancelled because the client
went away — stops the generation within one token and returns the slot
before ``aclose()`` completes; nothing the backend started outlives it.
Iterate a stream from one task at a time (a second concurrent reader gets
``anyio.BusyResourceError``); closing from another task is fine.

A generation that fails raises a ``HedgerowError`` from ``__anext__``:
``InvalidRequest`` (code ``context_length_exceeded``) when the prompt does not
fit the context window, ``RuntimeFault`` (code ``generation_failed``)
otherwise. ``finish_reason`` is ``"cancelled"`` only when a stream is closed
from another task while a token is being read.

Implementations: ``workers.llama_backend.LlamaBackend`` (llama.cpp) and
``workers.sim_backend.SimBackend`` (a latency model with failure injection,
for benchmarks and tests).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Iterable, Literal, Protocol, Self, TypeVar

import anyio

from hedgerow.errors import InvalidRequest

SlotT = TypeVar("SlotT")

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class GenerationRequest:
    """One chat (``messages``) or plain completion (``prompt``) request; exactly one is set."""

    messages: tuple[dict[str, str], ...] | None
    prompt: str | None
    max_tokens: int | None
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise InvalidRequest("a generation needs exactly one of messages or prompt")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class TokenChunk:
    """Text produced by the model, normally one token (several when a UTF-8 character spans tokens)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The last event of a stream, with OpenAI usage counts."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


GenerationEvent = TokenChunk | Finished


@dataclass(frozen=True)
class BackendLoad:
    """A snapshot for heartbeats and /metrics.

    ``active``: generations holding a slot; ``queued``: generations waiting for
    one; ``tokens_per_s``: the backend's whole decode rate over the last few
    seconds. Counters are totals since start: ``generations_total`` counts
    generations that got a slot and ended (any reason), ``cancelled_total``
    those stopped because their stream was closed before ``Finished``.
    """

    slots: int
    active: int
    queued: int
    tokens_per_s: float
    generations_total: int
    cancelled_total: int
    tokens_generated_total: int


class GenerationStream(Protocol):
    """The events of one generation; see the module docstring for the contract."""

    def __aiter__(self) -> GenerationStream: ...

    async def __anext__(self) -> GenerationEvent: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> GenerationStream: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


class GenerationStreamBase:
    """The plumbing every generation stream shares: it is its own async
    iterator, and leaving ``async with`` closes it. Subclasses define
    ``__anext__`` and ``aclose``."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def aclose(self) -> None:
        raise NotImplementedError


class Backend(Protocol):
    models: tuple[str, ...]
    slots: int
    kind: str  # "gpu" | "cpu" | "sim" (hedgerow.wire.WorkerKind)
    device: str | None

    def generate(self, request: GenerationRequest) -> GenerationStream: ...

    def load(self) -> BackendLoad: ...


class DecodeRateMeter:
    """Tokens per second over a sliding window, counted in fixed time buckets (sans-IO)."""

    def __init__(self, window_s: float = 5.0, bucket_s: float = 0.25) -> None:
        if window_s <= 0 or bucket_s <= 0 or bucket_s > window_s:
            raise ValueError("need 0 < bucket_s <= window_s")
        self._window_s = window_s
        self._bucket_s = bucket_s
        self._buckets: deque[list[int]] = deque()  # [bucket index, tokens]

    def record(self, now: float, tokens: int = 1) -> None:
        index = math.floor(now / self._bucket_s)
        if self._buckets and self._buckets[-1][0] == index:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([index, tokens])
        self._forget_before(now)

    def rate(self, now: float) -> float:
        self._forget_before(now)
        return sum(tokens for _, tokens in self._buckets) / self._window_s

    def _forget_before(self, now: float) -> None:
        oldest = math.floor((now - self._window_s) / self._bucket_s)
        while self._buckets and self._buckets[0][0] <= oldest:
            self._buckets.popleft()


class GenerationCounters:
    """What every backend counts for ``load()``: tokens (and their recent
    rate), generations ended, and how many of those were cancelled."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._meter = DecodeRateMeter()
        self.generations_total = 0
        self.cancelled_total = 0
        self.tokens_generated_total = 0

    def record_tokens(self, count: int = 1) -> None:
        self.tokens_generated_total += count
        self._meter.record(self._clock(), count)

    def record_end(self, cancelled: bool) -> None:
        self.generations_total += 1
        self.cancelled_total += cancelled

    def load(self, slots: int, pool: SlotPool[Any]) -> BackendLoad:
        return BackendLoad(
            slots=slots,
            active=pool.in_use,
            queued=pool.waiting,
            tokens_per_s=self._meter.rate(self._clock()),
            generations_total=self.generations_total,
            cancelled_total=self.cancelled_total,
            tokens_generated_total=self.tokens_generated_total,
        )


class SlotPool(Generic[SlotT]):
    """Hands out a fixed set of slots first come, first served.

    A released slot goes straight to the oldest waiter, so a newcomer never
    overtakes the queue. State changes are synchronous; only waiting awaits.
    """

    def __init__(self, slots: Iterable[SlotT]) -> None:
        self._free: deque[SlotT] = deque(slots)
        self.size = len(self._free)
        self._waiters: deque[_SlotWaiter[SlotT]] = deque()

    @property
    def in_use(self) -> int:
        return self.size - len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> SlotT:
        if self._free and not self._waiters:
            return self._free.popleft()
        waiter: _SlotWaiter[SlotT] = _SlotWaiter()
        self._waiters.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            self._withdraw(waiter)
            raise
        return waiter.slot()

    def release(self, slot: SlotT) -> None:
        if self._waiters:
            self._waiters.popleft().grant(slot)
        else:
            self._free.append(slot)

    def _withdraw(self, waiter: _SlotWaiter[SlotT]) -> None:
        if waiter.granted.is_set():
            self.release(waiter.slot())  # granted while being cancelled: pass it on
        else:
            self._waiters.remove(waiter)


class _SlotWaiter(Generic[SlotT]):
    def __init__(self) -> None:
        self.granted = anyio.Event()
        self._slot: list[SlotT] = []

    def grant(self, slot: SlotT) -> None:
        self._slot.append(slot)
        self.granted.set()

    def slot(self) -> SlotT:
        return self._slot[0]
