"""A simulated model behind the ``Backend`` seam, for benchmarks and tests only.

``SimBackend`` keeps the whole ``GenerationStream`` contract of
``workers.backend`` — FIFO slots, one reader at a time, ``aclose()`` that
stops at once and returns the slot, the same ``BackendLoad`` counters — but
instead of running a model it sleeps as a ``LatencyModel`` says and emits
deterministic filler text (``"tok1 "``, ``"tok2 "``, ...).

Timing of one generation, once it holds a slot::

    first token   after prefill_ms_per_token × prompt_tokens
    each next     after decode_ms_per_token
    Finished      right after the last token

Every sleep is multiplied by a jitter factor drawn uniformly from
``[1 - jitter, 1 + jitter]`` (mean 1, bounded), and a straggler request (drawn
with ``straggler_probability``) has all of its sleeps multiplied by
``straggler_factor``. Stragglers drawn that way are independent of each
other; ``SlowPeriods`` makes them correlated instead: wall-clock time is cut
into windows of ``seconds``, each slow with ``probability`` (a seeded hash of
the window's index, so every process given the same seed agrees on which
windows are slow whenever it started), and a generation created inside a
slow window has its sleeps multiplied by ``factor`` — a worker slow for
seconds at a time, as one with a noisy neighbour, a GC pause or a throttled
GPU is. Prompt tokens are estimated as ``len(text) // 4`` (at
least 1); a request without ``max_tokens`` produces ``output_tokens`` tokens
and finishes with ``"stop"``, one with ``max_tokens`` produces exactly that
many and finishes with ``"length"``. Stop sequences are ignored.

Failure injection, drawn per generation:

* ``failure_probability``: the prefill runs, then ``__anext__`` raises
  ``SimulatedFailure`` (500) before any token — the worker app answers a 500
  error envelope, which the gateway treats as a retryable upstream failure.
* ``mid_stream_failure_probability``: after ``k`` tokens (``k`` uniform in
  ``1..n``), ``__anext__`` raises ``SimulatedStreamBreak`` instead of the next
  event. The worker app has already sent its 200 response by then, so it cuts
  the HTTP response without finishing it (see ``workers.app``): the gateway
  sees a broken stream, exactly as if the worker process had died.

All fates of a generation (straggler, failure, break point, jitter) come from
its own ``random.Random`` seeded from the backend's seeded generator when
``generate()`` is called, so a run with a given ``rng_seed`` is reproducible
however the streams interleave. Sleep and clock are injectable, so tests can
run in virtual time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import anyio

from hedgerow.errors import InvalidRequest, RuntimeFault
from workers.backend import (
    BackendLoad,
    GenerationStreamBase,
    GenerationCounters,
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    SlotPool,
    TokenChunk,
)

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


class SimulatedFailure(RuntimeFault):
    """An injected failure before the first token (HTTP 500)."""

    default_code = "simulated_failure"


class SimulatedStreamBreak(SimulatedFailure):
    """An injected failure after some tokens were produced: the stream breaks."""

    default_code = "simulated_stream_break"


@dataclass(frozen=True)
class LatencyModel:
    """How long a simulated generation takes and how it fails; see the module docstring."""

    prefill_ms_per_token: float = 0.5
    decode_ms_per_token: float = 10.0
    jitter: float = 0.0
    straggler_probability: float = 0.0
    straggler_factor: float = 10.0
    failure_probability: float = 0.0
    mid_stream_failure_probability: float = 0.0
    output_tokens: int = 32

    def __post_init__(self) -> None:
        if self.prefill_ms_per_token < 0 or self.decode_ms_per_token < 0:
            raise ValueError("per-token latencies must be >= 0 ms")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter is a fraction in [0, 1)")
        if self.straggler_factor < 1:
            raise ValueError("straggler_factor must be >= 1")
        if self.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        for name in ("straggler_probability", "failure_probability", "mid_stream_failure_probability"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1]")


@dataclass(frozen=True)
class SlowPeriods:
    """Correlated stragglers: windows of wall-clock time in which a worker is slow."""

    probability: float  # of each window being slow
    seconds: float  # window length
    factor: float  # how much slower every sleep is inside a slow window
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.probability <= 1:
            raise ValueError("slow-period probability must be in [0, 1]")
        if self.seconds <= 0:
            raise ValueError("slow-period length must be > 0 s")
        if self.factor < 1:
            raise ValueError("slow-period factor must be >= 1")

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> SlowPeriods:
        """``PROBABILITY:SECONDS:FACTOR``, e.g. ``0.1:2:10``."""
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"slow periods want PROBABILITY:SECONDS:FACTOR, got {spec!r}")
        try:
            probability, seconds, factor = (float(part) for part in parts)
        except ValueError as error:
            raise ValueError(f"slow periods want three numbers, got {spec!r}") from error
        return cls(probability, seconds, factor, seed)

    def slow(self, now: float) -> bool:
        """Whether wall-clock time ``now`` falls in a slow window."""
        window = int(now // self.seconds)
        digest = hashlib.blake2b(f"{self.seed}:{window}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < self.probability

    def factor_at(self, now: float) -> float:
        return self.factor if self.slow(now) else 1.0


@dataclass(frozen=True)
class SimulatedFate:
    """What will happen to one generation, decided when it is created."""

    prompt_tokens: int
    output_tokens: int
    finish_reason: FinishReason
    slowdown: float  # straggler_factor for stragglers, else 1
    fails_before_first_token: bool
    breaks_after: int | None  # tokens produced before the stream breaks


def estimate_prompt_tokens(request: GenerationRequest) -> int:
    """About four characters per token, at least one."""
    if request.messages is not None:
        text = "".join(message.get("content", "") for message in request.messages)
    else:
        text = request.prompt or ""
    return max(1, len(text) // 4)


def draw_fate(request: GenerationRequest, latency: LatencyModel, rng: random.Random) -> SimulatedFate:
    """Decide one generation's length and failures; draws in a fixed order."""
    straggler = rng.random() < latency.straggler_probability
    fails = rng.random() < latency.failure_probability
    breaks = rng.random() < latency.mid_stream_failure_probability
    output = request.max_tokens if request.max_tokens is not None else latency.output_tokens
    break_point = rng.randint(1, output)
    return SimulatedFate(
        prompt_tokens=estimate_prompt_tokens(request),
        output_tokens=output,
        finish_reason="stop" if request.max_tokens is None else "length",
        slowdown=latency.straggler_factor if straggler else 1.0,
        fails_before_first_token=fails,
        breaks_after=break_point if breaks else None,
    )


class SimBackend:
    """``Backend`` over ``slots`` simulated model instances of ``model_name``."""

    kind: Final = "sim"
    device: str | None = None
    device_memory_bytes: int | None = None

    def __init__(
        self,
        model_name: str,
        slots: int,
        latency: LatencyModel,
        rng_seed: int | None = None,
        *,
        sleep: Sleep = anyio.sleep,
        clock: Clock = time.monotonic,
        slow_periods: SlowPeriods | None = None,
        wall_clock: Clock = time.time,
    ) -> None:
        if slots < 1:
            raise ValueError("a backend needs at least one slot")
        self.models: tuple[str, ...] = (model_name,)
        self.slots = slots
        self.latency = latency
        self._rng = random.Random(rng_seed)
        self._sleep = sleep
        self._counters = GenerationCounters(clock)
        self._pool: SlotPool[int] = SlotPool(range(slots))
        # Wall-clock, not monotonic: processes given one seed share slow windows.
        self.slow_periods = slow_periods
        self._wall_clock = wall_clock

    def generate(self, request: GenerationRequest) -> SimGeneration:
        # Simulated text cannot honour these; a 400 beats an answer that ignores them.
        for asked, param in ((request.tool_mode, "tools"), (request.response_schema,
                             "response_format"), (request.logprobs or None, "logprobs")):
            if asked is not None:
                raise InvalidRequest(f"the simulated backend does not honour {param}",
                                     param=param, code="unsupported_parameter")
        rng = random.Random(self._rng.getrandbits(64))
        fate = draw_fate(request, self.latency, rng)
        if self.slow_periods is not None:
            slow = self.slow_periods.factor_at(self._wall_clock())
            if slow > fate.slowdown:
                fate = dataclasses.replace(fate, slowdown=slow)
        return SimGeneration(fate, self.latency, rng, self._pool, self._sleep,
                             self._counters.record_tokens, self._counters.record_end)

    def load(self) -> BackendLoad:
        return self._counters.load(self.slots, self._pool)


class SimGeneration(GenerationStreamBase):
    """One simulated generation (a ``GenerationStream``)."""

    def __init__(
        self,
        fate: SimulatedFate,
        latency: LatencyModel,
        rng: random.Random,
        pool: SlotPool[int],
        sleep: Sleep,
        on_token: Callable[[], None],
        on_end: Callable[[bool], None],
    ) -> None:
        self.fate = fate
        self._latency = latency
        self._rng = rng
        self._pool = pool
        self._sleep = sleep
        self._on_token = on_token
        self._on_end = on_end
        self._slot: int | None = None
        self._read_scope: anyio.CancelScope | None = None  # the read in progress, if any
        self._produced = 0
        self._ended = False  # Finished was returned, or the generation failed
        self._closed = False

    async def __anext__(self) -> GenerationEvent:
        if self._ended or self._closed:
            raise StopAsyncIteration
        if self._read_scope is not None:
            raise anyio.BusyResourceError("reading from")
        self._read_scope = anyio.CancelScope()
        try:
            with self._read_scope:  # cancelled by aclose() from another task
                return await self._next_event()
        finally:
            self._read_scope = None
        return self._finish("cancelled")  # only reached when aclose() cancelled the read

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._read_scope is not None:
            self._read_scope.cancel()
        if self._slot is not None:
            self._on_end(not self._ended)
            self._pool.release(self._slot)
            self._slot = None

    async def _next_event(self) -> GenerationEvent:
        if self._slot is None:
            if not await self._take_slot():
                return self._finish("cancelled")
            await self._pause(self._latency.prefill_ms_per_token * self.fate.prompt_tokens)
            if self.fate.fails_before_first_token:
                self._ended = True
                raise SimulatedFailure("simulated failure before the first token")
        elif self._produced < self.fate.output_tokens:
            await self._pause(self._latency.decode_ms_per_token)
        if self._produced == self.fate.breaks_after:
            self._ended = True
            raise SimulatedStreamBreak(f"simulated stream break after {self._produced} tokens")
        if self._produced == self.fate.output_tokens:
            return self._finish(self.fate.finish_reason)
        self._produced += 1
        self._on_token()
        return TokenChunk(f"tok{self._produced} ")

    async def _take_slot(self) -> bool:
        slot = await self._pool.acquire()
        if self._closed:  # closed while the grant was on its way: pass the slot on
            self._pool.release(slot)
            return False
        self._slot = slot
        return True

    async def _pause(self, ms: float) -> None:
        spread = self._latency.jitter
        factor = self._rng.uniform(1 - spread, 1 + spread) if spread else 1.0
        await self._sleep(ms * factor * self.fate.slowdown / 1000)

    def _finish(self, reason: FinishReason) -> Finished:
        self._ended = True
        return Finished(reason, self.fate.prompt_tokens, self._produced)
