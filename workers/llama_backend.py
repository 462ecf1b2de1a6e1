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
``warm_up()`` (blocking too) then runs one short generation in every slot so
the first real request does not pay for first-use setup.

**Prompt reuse.** A slot keeps the KV cache of its last prompt and answer,
and llama-cpp-python evaluates only the part of a new prompt after the
longest prefix it shares with them. So a conversation's next turn (or any
prompt with the same system prompt) recomputes only its new tokens when it
lands in the slot that served the previous one: a free slot is picked by the
longest shared prefix of text when that covers most of the prompt, else an
empty slot, else the least recently used (``workers.backend.slot_preference``). Each generation reports its reused tokens (``BackendLoad``'s
``prompt_cache_*`` and ``prompt_tokens_reused_total``). ``prompt_reuse=False``
clears the slot before every generation, and ``slot_affinity=False`` hands
out free slots in turn without looking at what they hold, leaving only
llama-cpp-python's own reuse of whatever prefix its context happens to
share with the prompt: its default behaviour (both for comparison benchmarks).

**Prompt-lookup decoding.** With ``prompt_lookup_tokens=N`` every slot gets
llama-cpp-python's ``LlamaPromptLookupDecoding`` as its draft model: up to N
tokens copied from the prompt where its last n-gram appeared before are
verified in one forward pass, which pays off when the answer copies its input
(extraction, editing, code). Output is unchanged at temperature 0. Accepted
drafts are counted as sampled tokens minus forward passes (each pass yields
its accepted drafts plus one token of its own), exact except when a
generation stops in the middle of a pass. It costs memory: llama-cpp-python
then keeps logits for every position (n_ctx x vocabulary floats per slot);
the prompt's pass skips them (only its last position is sampled).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Literal, Sequence

import anyio
import anyio.to_thread
import llama_cpp
import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from hedgerow.errors import InvalidRequest, ModelUnavailable, RuntimeFault
from workers.backend import (
    ASSISTANT_MARK,
    BackendLoad,
    GenerationStreamBase,
    GenerationCounters,
    Finished,
    FinishReason,
    GenerationEvent,
    GenerationRequest,
    SlotPool,
    TokenChunk,
    ToolCallDelta,
    prompt_text,
    slot_preference,
)
from workers.llama_chat import Chunk, chat_formatter, llama_chunks
from workers.tool_calls import (
    CallStart,
    TextOut,
    ToolCallScanner,
    grammar_for,
    known_call,
)
from workers.device import CPU_DEVICE, DeviceInfo, detect_device

# llama-cpp-python reports a prompt longer than n_ctx as a ValueError with this text.
_CONTEXT_OVERFLOW_TEXT = "exceed context window"


class _TokenTally:
    """What the metered token generator saw in one generation (written by its worker thread)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.prompt_tokens = 0
        self.reused_tokens = 0  # prompt tokens whose KV the slot already held
        self.completion_tokens = 0
        self.sampled_tokens = 0  # completion tokens plus the end-of-generation token
        self.forward_passes = 0  # llama eval calls: the prompt's, then one per decode step
        self.drafted_tokens = 0
        # max_tokens, enforced here: llama-cpp-python checks it only after a token
        # that completes a character, so a multi-byte character split across the
        # last tokens made it sample one more (41 tokens for max_tokens 40).
        self.limit: int | None = None
        # None: no logprobs wanted; else how many alternatives per token.
        self.top_logprobs: int | None = None
        self.logprobs: list[dict[str, Any]] = []  # entries not yet handed out

    @property
    def accepted_drafts(self) -> int:
        """Drafted tokens the model kept: each pass yields its accepted drafts plus one."""
        return max(0, self.sampled_tokens - self.forward_passes) if self.drafted_tokens else 0


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
        self.cached_text = ""  # the text whose KV this slot holds (prompt + answer), for affinity
        self._vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.chat_formatter = chat_formatter(self)
        if self.draft_model is not None:
            self.draft_model = _CountingDraft(self.draft_model, self)

    def generate(  # type: ignore[override]  # forwards llama's sampling keywords untouched
        self, tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> Generator[int, None, None]:
        tally = self.tally
        if not tally.forward_passes:  # a generation's first step (auto's second one is not)
            tally.prompt_tokens = len(tokens)
            tally.reused_tokens = (self._reusable_prefix(tokens) if kwargs.get("reset", True)
                                   else 0)
        with contextlib.closing(super().generate(tokens, *args, **kwargs)) as sampled:
            for token in sampled:
                if tally.stop.is_set():
                    return
                tally.sampled_tokens += 1
                if not llama_cpp.llama_vocab_is_eog(self._vocab, token):
                    tally.completion_tokens += 1
                    if tally.top_logprobs is not None:
                        tally.logprobs.append(self._logprob_entry(token, tally.top_logprobs))
                yield token
                if tally.limit is not None and tally.completion_tokens >= tally.limit:
                    return  # llama-cpp-python then ends with finish_reason "length"

    def _logprob_entry(self, token: int, top: int) -> dict[str, Any]:
        """OpenAI's logprob entry for ``token``, from the logits it was sampled from
        (the last position evaluated; llama-cpp-python keeps them only with
        logits_all, which costs n_ctx x vocabulary floats)."""
        vocabulary = self.n_vocab()
        logits = np.ctypeslib.as_array(self._ctx.get_logits_ith(-1), shape=(vocabulary,))
        shifted = logits - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        entry = self._token_entry(token, float(logprobs[token]))
        best = np.argpartition(-logprobs, top)[:top] if top else np.array([], dtype=int)
        ranked = sorted(best.tolist(), key=lambda t: -logprobs[t])
        entry["top_logprobs"] = [self._token_entry(t, float(logprobs[t])) for t in ranked]
        return entry

    def _token_entry(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.detokenize([token])
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}

    def eval(self, tokens: Sequence[int]) -> None:
        self.tally.forward_passes += 1
        if self.draft_model is None or self.tally.forward_passes > 1:
            super().eval(tokens)
            return
        # A generation's first pass is its prompt, sampled at the last position
        # only: skip the logits of every other position that drafting needs.
        self._logits_all = False
        try:
            super().eval(tokens)
        finally:
            self._logits_all = True

    def _reusable_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` ``generate`` will take from the KV cache."""
        held = self.input_ids[: self.n_tokens]
        n = min(len(held), len(tokens))
        if n == 0:
            return 0
        differ = np.flatnonzero(held[:n] != np.asarray(tokens[:n], dtype=held.dtype))
        common = int(differ[0]) if differ.size else n
        # A prompt held whole is re-evaluated from its last token (to refresh the logits).
        return common - 1 if common == len(tokens) else common


class _CountingDraft(LlamaDraftModel):
    """A draft model that adds the tokens it proposes to its slot's tally."""

    def __init__(self, inner: LlamaDraftModel, owner: _MeteredLlama) -> None:
        self._inner = inner
        self._owner = owner

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        drafted = self._inner(input_ids, **kwargs)
        self._owner.tally.drafted_tokens += len(drafted)
        return drafted


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
        prompt_reuse: bool = True,
        prompt_lookup_tokens: int = 0,
        slot_affinity: bool = True,
    ) -> None:
        if slots < 1:
            raise ValueError("a backend needs at least one slot")
        if prompt_lookup_tokens < 0:
            raise ValueError("prompt_lookup_tokens must be 0 (off) or more")
        self.models: tuple[str, ...] = (model_name,)
        self.slots = slots
        placed = _placement(device, n_gpu_layers)
        self.kind: Literal["gpu", "cpu"] = placed.kind
        self.device, self.device_memory_bytes = placed.name, placed.memory_bytes
        self.n_ctx = n_ctx
        self.prompt_reuse = prompt_reuse
        self.slot_affinity = slot_affinity
        self.prompt_lookup_tokens = prompt_lookup_tokens
        threads = n_threads or default_threads_per_slot(slots)
        self._llamas = [_load_llama(model_path, n_ctx, n_gpu_layers, threads, prompt_lookup_tokens)
                        for _ in range(slots)]
        self._pool: SlotPool[_MeteredLlama] = SlotPool(self._llamas)
        self._counters = GenerationCounters(clock)

    def generate(self, request: GenerationRequest) -> LlamaGeneration:
        vocabulary = self._llamas[0].n_vocab()
        for token, _ in request.logit_bias:
            # llama-cpp-python would index its logits with it: out of range is
            # an IndexError mid-generation, or a wrong token if negative.
            if not 0 <= token < vocabulary:
                raise InvalidRequest(f"logit_bias names token {token}; this model's token ids "
                                     f"run from 0 to {vocabulary - 1}", param="logit_bias",
                                     code="invalid_value")
        if request.logprobs and self.prompt_lookup_tokens:
            # Drafted tokens are sampled several positions at a time; their
            # logits are not where _logprob_entry reads them.
            raise InvalidRequest("logprobs are not available on a worker running prompt-lookup "
                                 "decoding", param="logprobs", code="unsupported_parameter")
        # Built here, so a schema no grammar can express is a 400 before any slot
        # is taken ("auto" then uses it only with response_format: llama_chat).
        grammar = grammar_for(request.tools, request.tool_mode, request.response_schema)
        return LlamaGeneration(request, self._pool, self.n_ctx, self._counters, self.prompt_reuse,
                               grammar, self.slot_affinity)

    def load(self) -> BackendLoad:
        return self._counters.load(self.slots, self._pool)

    def warm_up(self) -> None:
        """Run one short generation in every slot (blocking; call before taking traffic).

        The first generation in a fresh llama.cpp context pays one-off costs
        (compute buffers, thread start-up, weights paged in); this pays them
        here instead of in a client's first-token time. Not counted in load().
        """
        for llama in self._llamas:
            llama.tally = _TokenTally()
            llama.create_completion(prompt="Hello", max_tokens=4, temperature=0.0, seed=0)
            llama.reset()  # type: ignore[no-untyped-call]  # unannotated in llama-cpp-python
            llama.cached_text = ""

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
        counters: GenerationCounters,
        prompt_reuse: bool = True,
        grammar: str | None = None,
        slot_affinity: bool = True,
    ) -> None:
        self._request = request
        self._grammar = grammar
        known = known_call(request.tools, request.tool_mode)
        self._scanner = ToolCallScanner(request.tool_mode if request.is_chat else None,
                                        known.name if known is not None else None)
        self._pending: deque[GenerationEvent] = deque()
        self._pool = pool
        self._n_ctx = n_ctx
        self._counters = counters
        self._prompt_reuse = prompt_reuse
        self._slot_affinity = slot_affinity and prompt_reuse
        self._prompt_text = prompt_text(request)
        self._answer: list[str] = []
        self._llama: _MeteredLlama | None = None
        self._tally = _TokenTally()
        self._tally.limit = request.max_tokens
        self._tally.top_logprobs = request.top_logprobs if request.logprobs else None
        self._chunks: Generator[Chunk, None, None] | None = None
        self._limiter = anyio.CapacityLimiter(1)  # own limiter: never queue behind other to_thread users
        self._slot_wait = anyio.CancelScope()
        self._read_done: anyio.Event | None = None
        self._finish_reason: FinishReason | None = None
        self._ended = False  # Finished was returned, or the generation failed
        self._cut_short = False  # Finished was "cancelled": closed from another task mid-read
        self._closed = False
        self._reported_tokens = 0

    async def __anext__(self) -> GenerationEvent:
        if self._pending and not self._closed:
            return self._pending.popleft()
        if self._ended or self._closed:
            raise StopAsyncIteration
        if self._finish_reason is not None:
            return self._finish()
        if self._read_done is not None:
            raise anyio.BusyResourceError("reading from")
        self._read_done = anyio.Event()
        try:
            # A call's head is held back until its name is known: read on until
            # there is something to hand out.
            while not self._pending and self._finish_reason is None:
                text, reason, logprobs = await self._read()
                self._shape(text, reason, logprobs)
        finally:
            self._read_done.set()
            self._read_done = None
        return self._pending.popleft() if self._pending else self._finish()

    def _shape(self, text: str, reason: str | None, logprobs: list[dict[str, Any]]) -> None:
        """One piece of the model's text as events (content with its logprobs, or
        tool-call deltas); at the end, what the scanner still held."""
        if text:
            self._answer.append(text)
        outs = self._scanner.feed(text)
        if reason is not None:
            self._finish_reason = "length" if reason == "length" else "stop"
            outs += self._scanner.finish(complete=reason != "length")
        for out in outs:
            if isinstance(out, TextOut):
                self._pending.append(TokenChunk(out.text, tuple(logprobs)))
                logprobs = []  # the tokens' entries go with the first text they made
            elif isinstance(out, CallStart):
                self._pending.append(ToolCallDelta(0, "", id=out.id, name=out.name))
            else:
                self._pending.append(ToolCallDelta(0, out.fragment))

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

    async def _read(self) -> tuple[str, str | None, list[dict[str, Any]]]:
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
        affinity = (lambda slot: slot_preference(slot.cached_text, self._prompt_text)
                    ) if self._slot_affinity else None
        with self._slot_wait:  # cancelled by aclose() from another task
            llama = await self._pool.acquire(affinity)
            llama.tally = self._tally
            self._llama = llama

    def _read_blocking(self) -> tuple[str, str | None, list[dict[str, Any]]]:
        if self._chunks is None:
            assert self._llama is not None
            if not self._prompt_reuse:
                # forget the KV cache: the whole prompt is evaluated again
                self._llama.reset()  # type: ignore[no-untyped-call]  # unannotated upstream
            self._chunks = llama_chunks(self._llama, self._request, self._grammar)
        for text, reason in self._chunks:
            if text or reason is not None:
                return text, reason, self._taken_logprobs()
        return "", "stop", self._taken_logprobs()

    def _taken_logprobs(self) -> list[dict[str, Any]]:
        taken, self._tally.logprobs = self._tally.logprobs, []
        return taken

    def _release_slot(self, llama: _MeteredLlama) -> None:
        try:
            if self._chunks is not None:
                # GeneratorExit only unwinds llama-cpp-python's Python generators; no model code runs.
                self._chunks.close()
        finally:
            self._llama = None
            self._record_slot_use(llama)
            self._counters.record_end(self._cut_short or not self._ended)
            self._pool.release(llama)

    def _record_slot_use(self, llama: _MeteredLlama) -> None:
        tally = self._tally
        if tally.prompt_tokens:  # the prompt was evaluated (not refused before, e.g. too long)
            self._counters.record_prompt(tally.prompt_tokens, tally.reused_tokens)
            self._counters.record_drafts(tally.drafted_tokens, tally.accepted_drafts)
        # What the slot's KV now holds, as text: this prompt and the answer so far.
        held = self._prompt_text + ASSISTANT_MARK + "".join(self._answer)
        llama.cached_text = held if self._prompt_reuse and tally.prompt_tokens else ""

    def _finish(self) -> Finished:
        self._ended = True
        self._cut_short = self._tally.stop.is_set()
        reason: FinishReason = "cancelled" if self._cut_short else self._finish_reason or "stop"
        if reason == "stop" and self._scanner.called:
            reason = "tool_calls"
        return Finished(reason, self._tally.prompt_tokens, self._tally.completion_tokens)

    def _report_tokens(self) -> None:
        new_tokens = self._tally.completion_tokens - self._reported_tokens
        self._reported_tokens = self._tally.completion_tokens
        if new_tokens:
            self._counters.record_tokens(new_tokens)

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


def default_threads_per_slot(slots: int) -> int:
    """Split the CPUs this process may use evenly between slots, at least one thread each."""
    return max(1, _usable_cpus() // slots)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _placement(device: DeviceInfo | None, n_gpu_layers: int) -> DeviceInfo:
    if n_gpu_layers == 0:
        return CPU_DEVICE
    return device or detect_device()


def _load_llama(
    model_path: Path, n_ctx: int, n_gpu_layers: int, threads: int, lookup_tokens: int = 0
) -> _MeteredLlama:
    if not model_path.is_file():
        raise ModelUnavailable(f"model file not found: {model_path}")
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if lookup_tokens else None
    try:
        return _MeteredLlama(
            model_path=str(model_path),
            n_ctx=n_ctx,
            n_gpu_layers=n_gpu_layers,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            verbose=False,
        )
    except ValueError as exc:  # llama-cpp-python's way of saying the file would not load
        raise ModelUnavailable(f"cannot load model {model_path}: {exc}") from exc
