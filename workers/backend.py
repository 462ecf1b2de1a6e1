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
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, Iterable, Literal, Protocol, Self, TypeVar

import anyio

from hedgerow.errors import InvalidRequest
from hedgerow.wire import WorkerKind
from workers.tool_calls import ToolSpec

SlotT = TypeVar("SlotT")

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


@dataclass(frozen=True)
class GenerationRequest:
    """One chat (``messages``) or plain completion (``prompt``) request; exactly one is set."""

    messages: tuple[dict[str, Any], ...] | None
    prompt: str | None
    max_tokens: int | None
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, int], ...] = ()  # (token id, bias)
    # Tool use (workers.tool_calls): the functions, and None (answer in text),
    # "auto", "required" or "function:NAME".
    tools: tuple[ToolSpec, ...] = ()
    tool_mode: str | None = None
    # response_format as a JSON Schema (JSON text); json_object is {"type": "object"}.
    response_schema: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0

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
    """Text produced by the model, normally one token (several when a UTF-8 character spans tokens).

    ``logprobs``: OpenAI's entries (token, logprob, bytes, top_logprobs) of
    the tokens behind it, when the request asked for them."""

    text: str
    logprobs: tuple[dict[str, Any], ...] = ()
    choice: int = 0  # which of the request's n choices (SeveralChoices)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call: the first names it (``id``, ``name``), the rest
    carry fragments of its JSON ``arguments``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None
    choice: int = 0


@dataclass(frozen=True)
class Finished:
    """The last event of a stream, with OpenAI usage counts."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    choice: int = 0
    # False for every choice but the last of several: usage comes once, at the end.
    final: bool = True

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


GenerationEvent = TokenChunk | ToolCallDelta | Finished


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
    # Prompt reuse (backends with a prompt cache; zero elsewhere): generations
    # whose prompt started with tokens a slot still held (hit) or not (miss),
    # and how many prompt tokens were taken from the cache instead of computed.
    prompt_cache_hits_total: int = 0
    prompt_cache_misses_total: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_reused_total: int = 0
    # Speculative (prompt-lookup) decoding: tokens drafted, and drafted tokens the model accepted.
    draft_tokens_total: int = 0
    draft_tokens_accepted_total: int = 0


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


class SeveralChoices(GenerationStreamBase):
    """``n`` choices as one stream: each generated in turn (each takes a slot
    when it starts and frees it when it ends), its events marked with its
    ``choice``. The last ``Finished`` carries the request's usage: the prompt
    once, the completions of every choice summed."""

    def __init__(self, first: GenerationStream,
                 more: list[Callable[[], GenerationStream]]) -> None:
        self._current: GenerationStream | None = first
        self._more = more
        self._choice = 0
        self._completion_tokens = 0

    async def __anext__(self) -> GenerationEvent:
        while self._current is not None:
            try:
                event = await self._current.__anext__()
            except StopAsyncIteration:
                await self._advance()
                continue
            if not isinstance(event, Finished):
                return replace(event, choice=self._choice)
            self._completion_tokens += event.completion_tokens
            choice = self._choice
            await self._advance(stop=event.finish_reason == "cancelled")
            final = self._current is None
            return replace(event, choice=choice, final=final, completion_tokens=(
                self._completion_tokens if final else event.completion_tokens))
        raise StopAsyncIteration

    async def _advance(self, stop: bool = False) -> None:
        done, self._current = self._current, None
        if done is not None:
            await done.aclose()
        if self._more and not stop:
            self._current = self._more.pop(0)()
            self._choice += 1

    async def aclose(self) -> None:
        self._more.clear()
        current, self._current = self._current, None
        if current is not None:
            await current.aclose()


class Backend(Protocol):
    models: tuple[str, ...]
    slots: int
    device: str | None  # the GPU's name on a GPU worker
    device_memory_bytes: int | None  # and its memory

    @property
    def kind(self) -> WorkerKind: ...  # read-only: a backend may promise a narrower kind

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
        self.prompt_cache_hits = 0
        self.prompt_cache_misses = 0
        self.prompt_tokens_total = 0
        self.prompt_tokens_reused_total = 0
        self.draft_tokens_total = 0
        self.draft_tokens_accepted_total = 0

    def record_tokens(self, count: int = 1) -> None:
        self.tokens_generated_total += count
        self._meter.record(self._clock(), count)

    def record_end(self, cancelled: bool) -> None:
        self.generations_total += 1
        self.cancelled_total += cancelled

    def record_prompt(self, prompt_tokens: int, reused_tokens: int) -> None:
        """One generation's prompt: how many of its tokens came from the slot's cache."""
        self.prompt_tokens_total += prompt_tokens
        self.prompt_tokens_reused_total += reused_tokens
        if reused_tokens > 0:
            self.prompt_cache_hits += 1
        else:
            self.prompt_cache_misses += 1

    def record_drafts(self, drafted: int, accepted: int) -> None:
        self.draft_tokens_total += drafted
        self.draft_tokens_accepted_total += accepted

    def load(self, slots: int, pool: SlotPool[Any]) -> BackendLoad:
        return BackendLoad(
            slots=slots,
            active=pool.in_use,
            queued=pool.waiting,
            tokens_per_s=self._meter.rate(self._clock()),
            generations_total=self.generations_total,
            cancelled_total=self.cancelled_total,
            tokens_generated_total=self.tokens_generated_total,
            prompt_cache_hits_total=self.prompt_cache_hits,
            prompt_cache_misses_total=self.prompt_cache_misses,
            prompt_tokens_total=self.prompt_tokens_total,
            prompt_tokens_reused_total=self.prompt_tokens_reused_total,
            draft_tokens_total=self.draft_tokens_total,
            draft_tokens_accepted_total=self.draft_tokens_accepted_total,
        )


ASSISTANT_MARK = "\x00assistant\x01"


def prompt_text(request: GenerationRequest) -> str:
    """The request's prompt as one string whose prefixes match the next turn's.

    A chat's messages are joined with role marks, so the text of turn N plus
    its answer (``ASSISTANT_MARK`` + answer) is a prefix of turn N+1's text.
    """
    if request.messages is None:
        return request.prompt or ""
    return "".join(f"\x00{m.get('role', '')}\x01{m.get('content', '')}{m.get('tool_calls', '')}\x02"
                   for m in request.messages)


def shared_prefix_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    return len(os.path.commonprefix([a, b]))


# A slot is worth reusing when its cached text covers at least this much of the new prompt.
SIMILAR_PREFIX_FRACTION = 0.5


def slot_preference(held: str, wanted: str) -> tuple[int, int]:
    """How well a slot holding ``held`` suits a prompt ``wanted`` (higher is better).

    A slot that holds most of the prompt (at least ``SIMILAR_PREFIX_FRACTION``)
    comes first, the longest shared prefix best. Otherwise taking a slot
    destroys its cache for little gain, so an empty slot comes next, and then
    any other, which ``SlotPool`` breaks as "free the longest" (least recently
    used). The same rule as llama.cpp's server slot selection.
    """
    shared = shared_prefix_chars(held, wanted)
    if shared and shared >= SIMILAR_PREFIX_FRACTION * len(wanted):
        return (2, shared)
    return (1, 0) if not held else (0, 0)


class SlotPool(Generic[SlotT]):
    """Hands out a fixed set of slots first come, first served.

    A released slot goes straight to the oldest waiter, so a newcomer never
    overtakes the queue. State changes are synchronous; only waiting awaits.

    ``acquire(affinity)`` picks, among the free slots, the one ``affinity``
    scores highest (e.g. ``slot_preference``: the slot whose cached prompt
    shares the longest prefix with the request), ties going to the slot free
    the longest. A waiter takes whichever slot frees first: affinity never
    delays anyone.
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

    async def acquire(self, affinity: Callable[[SlotT], tuple[int, int]] | None = None) -> SlotT:
        if self._free and not self._waiters:
            if affinity is None or len(self._free) == 1:
                return self._free.popleft()
            best = max(range(len(self._free)), key=lambda i: (affinity(self._free[i]), -i))
            slot = self._free[best]
            del self._free[best]
            return slot
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
