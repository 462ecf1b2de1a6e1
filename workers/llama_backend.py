"""llama.cpp behind the ``Backend`` seam.

Each slot is its own ``llama_cpp.Llama`` (own weights mapping, own KV cache),
handed out FIFO by a ``SlotPool``. A generation is pull-driven: each
``__anext__`` advances llama-cpp-python's streaming generator by one event in
a worker thread, so model code never runs on the event loop, every token
reaches the consumer the moment it is produced, and no token is computed that
nobody asked for. Cancelling a read waits for the token in progress (at most
one) before the cancellation lands.

``aclose()`` sets the stop flag that the metered token generator checks
between tokens, waits (shielded) for a read still in flight in another task,
closes llama-cpp-python's generators, and only then returns the slot, so a
slot is never reused while its thread still runs.

Construction loads ``slots`` models and blocks (about 0.2 s each for the
bundled model); from async code use ``await anyio.to_thread.run_sync(...)``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Literal, Sequence

import anyio
import anyio.to_thread
import llama_cpp

from hedgerow.errors import InvalidRequest, ModelUnavailable, RuntimeFault
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
from workers.device import DeviceInfo, detect_device

# llama-cpp-python reports a prompt longer than n_ctx as a ValueError with this text.
_CONTEXT_OVERFLOW_TEXT = "exceed context window"
_Chunk = tuple[str, str | None]  # (text, llama's finish_reason)


class _TokenTally:
    """What the metered token generator saw in one generation (written by its worker thread)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.prompt_tokens = 0
        self.completion_tokens = 0


class _MeteredLlama(llama_cpp.Llama):
    """A Llama whose token generator counts tokens and honours a stop flag.

    ``create_completion`` and ``create_chat_completion`` both pull every token
    through ``self.generate(prompt_tokens, ...)``, so this one override gives
    exact usage (the same numbers llama-cpp-python reports when not
    streaming) and a stop check between tokens.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tally = _TokenTally()
        self._vocab = llama_cpp.llama_model_get_vocab(self.model)

    def generate(  # type: ignore[override]  # forwards llama's sampling keywords untouched
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, None, None]:
        tally = self.tally
        tally.prompt_tokens = len(tokens)
        with contextlib.closing(super().generate(tokens, *args, **kwargs)) as sampled:
            for token in sampled:
                if tally.stop.is_set():
                    return
                if not llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    tally.completion_tokens += 1
                yield token


class LlamaBackend:
    """``Backend`` over ``slots`` independent llama.cpp instances of one GGUF model.

    ``device`` says where ``n_gpu_layers`` go; when it is omitted and layers
    are offloaded, the device is detected (``workers.device.detect_device``).
    """

    def __init__(
        self,
        model_path: Path,
        model_name: str,
        slots: int,
        n_ctx: int = 2048,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        *,
        device: DeviceInfo | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if slots < 1:
            raise ValueError("a backend needs at least one slot")
        self.models: tuple[str, ...] = (model_name,)
        self.slots = slots
        self.kind, self.device = _placement(device, n_gpu_layers)
        self.n_ctx = n_ctx
        threads = n_threads or default_threads_per_slot(slots)
        self._llamas = [_load_llama(model_path, n_ctx, n_gpu_layers, threads) for _ in range(slots)]
        self._pool: SlotPool[_MeteredLlama] = SlotPool(self._llamas)
        self._counters = GenerationCounters(clock)

    def generate(self, request: GenerationRequest) -> LlamaGeneration:
        return LlamaGeneration(request, self._pool, self.n_ctx,
                               self._counters.record_tokens, self._counters.record_end)

    def load(self) -> BackendLoad:
        return self._counters.load(self.slots, self._pool)

    def close(self) -> None:
        """Free the models; call only once no generation is running."""
        for llama in self._llamas:
            llama.close()


class LlamaGeneration(GenerationStreamBase):
    """One generation (a ``GenerationStream``): takes a slot on the first read, gives it back on close."""

    def __init__(
        self,
        request: GenerationRequest,
        pool: SlotPool[_MeteredLlama],
        n_ctx: int,
        on_tokens: Callable[[int], None],
        on_end: Callable[[bool], None],
    ) -> None:
        self._request = request
        self._pool = pool
        self._n_ctx = n_ctx
        self._on_tokens = on_tokens
        self._on_end = on_end
        self._llama: _MeteredLlama | None = None
        self._tally = _TokenTally()
        self._chunks: Generator[_Chunk, None, None] | None = None
        self._limiter = anyio.CapacityLimiter(1)  # own limiter: never queue behind other to_thread users
        self._slot_wait = anyio.CancelScope()
        self._read_done: anyio.Event | None = None
        self._finish_reason: FinishReason | None = None
        self._ended = False  # Finished was returned, or the generation failed
        self._cut_short = False  # Finished was "cancelled": closed from another task mid-read
        self._closed = False
        self._reported_tokens = 0

    async def __anext__(self) -> GenerationEvent:
        if self._ended or self._closed:
            raise StopAsyncIteration
        if self._finish_reason is not None:
            return self._finish()
        if self._read_done is not None:
            raise anyio.BusyResourceError("reading from")
        self._read_done = anyio.Event()
        try:
            text, reason = await self._read()
        finally:
            self._read_done.set()
            self._read_done = None
        if reason is not None:
            self._finish_reason = "length" if reason == "length" else "stop"
        return TokenChunk(text) if text else self._finish()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tally.stop.set()
        self._slot_wait.cancel()
        if self._read_done is not None:
            with anyio.CancelScope(shield=True):
                await self._read_done.wait()
        if self._llama is not None:
            self._release_slot(self._llama)

    async def _read(self) -> _Chunk:
        if self._llama is None:
            await self._take_slot()
        if self._closed or self._llama is None:
            raise StopAsyncIteration
        try:
            with self._mapped_llama_errors():
                return await anyio.to_thread.run_sync(self._read_blocking, limiter=self._limiter)
        finally:
            self._report_tokens()

    async def _take_slot(self) -> None:
        with self._slot_wait:  # cancelled by aclose() from another task
            llama = await self._pool.acquire()
            llama.tally = self._tally
            self._llama = llama

    def _read_blocking(self) -> _Chunk:
        if self._chunks is None:
            assert self._llama is not None
            self._chunks = _llama_chunks(self._llama, self._request)
        for text, reason in self._chunks:
            if text or reason is not None:
                return text, reason
        return "", "stop"

    def _release_slot(self, llama: _MeteredLlama) -> None:
        try:
            if self._chunks is not None:
                # GeneratorExit only unwinds llama-cpp-python's Python generators; no model code runs.
                self._chunks.close()
        finally:
            self._llama = None
            self._on_end(self._cut_short or not self._ended)
            self._pool.release(llama)

    def _finish(self) -> Finished:
        self._ended = True
        self._cut_short = self._tally.stop.is_set()
        reason: FinishReason = "cancelled" if self._cut_short else self._finish_reason or "stop"
        return Finished(reason, self._tally.prompt_tokens, self._tally.completion_tokens)

    def _report_tokens(self) -> None:
        new_tokens = self._tally.completion_tokens - self._reported_tokens
        self._reported_tokens = self._tally.completion_tokens
        if new_tokens:
            self._on_tokens(new_tokens)

    @contextlib.contextmanager
    def _mapped_llama_errors(self) -> Iterator[None]:
        try:
            yield
        except ValueError as exc:
            self._ended = True
            if _CONTEXT_OVERFLOW_TEXT in str(exc):
                raise InvalidRequest(
                    f"the prompt does not fit this model's context window of {self._n_ctx} tokens",
                    code="context_length_exceeded",
                    param="messages" if self._request.is_chat else "prompt",
                ) from exc
            raise RuntimeFault(f"generation failed: {exc}", code="generation_failed") from exc
        except Exception as exc:
            self._ended = True
            raise RuntimeFault(f"generation failed: {exc!r}", code="generation_failed") from exc


def _llama_chunks(llama: llama_cpp.Llama, request: GenerationRequest) -> Generator[_Chunk, None, None]:
    """llama-cpp-python's stream for ``request`` as (text, finish_reason) pairs."""
    sampling = _sampling_arguments(request)
    if request.messages is not None:
        messages: Any = list(request.messages)
        stream: Any = llama.create_chat_completion(messages=messages, stream=True, **sampling)
        with contextlib.closing(stream):
            for chunk in stream:
                choice = chunk["choices"][0]
                yield choice["delta"].get("content") or "", choice["finish_reason"]
    else:
        stream = llama.create_completion(prompt=request.prompt or "", stream=True, **sampling)
        with contextlib.closing(stream):
            for chunk in stream:
                choice = chunk["choices"][0]
                yield choice["text"], choice["finish_reason"]


def _sampling_arguments(request: GenerationRequest) -> dict[str, Any]:
    # Without an explicit seed llama-cpp-python reuses one fixed seed for every
    # call, which would make every temperature > 0 answer identical.
    seed = request.seed if request.seed is not None else secrets.randbits(31)
    return {
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": seed,
        "stop": list(request.stop),
    }


def default_threads_per_slot(slots: int) -> int:
    """Split the CPUs this process may use evenly between slots, at least one thread each."""
    return max(1, _usable_cpus() // slots)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _placement(device: DeviceInfo | None, n_gpu_layers: int) -> tuple[Literal["gpu", "cpu"], str | None]:
    if n_gpu_layers == 0:
        return "cpu", None
    device = device or detect_device()
    return (device.kind, device.name) if device.kind == "gpu" else ("cpu", None)


def _load_llama(model_path: Path, n_ctx: int, n_gpu_layers: int, threads: int) -> _MeteredLlama:
    if not model_path.is_file():
        raise ModelUnavailable(f"model file not found: {model_path}")
    try:
        return _MeteredLlama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_gpu_layers=n_gpu_layers,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
    except ValueError as exc:  # llama-cpp-python's way of saying the file would not load
        raise ModelUnavailable(f"cannot load model {model_path}: {exc}") from exc
