"""LlamaBackend with the real bundled SmolLM2-135M model on the CPU."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import anyio
import llama_cpp
import pytest

from hedgerow.errors import InvalidRequest
from workers.backend import BackendLoad, Finished, GenerationEvent, GenerationRequest, TokenChunk
from workers.llama_backend import LlamaBackend
from workers.models import DEFAULT_MODEL_NAME, bundled_model_path

COUNTING = ({"role": "user", "content": "Count from 1 to 100, separated by commas."},)
GREETING = ({"role": "user", "content": "Say hi."},)  # SmolLM2 answers in ~25 tokens, then stops


@pytest.fixture(scope="module")
def backend() -> Iterator[LlamaBackend]:
    loaded = LlamaBackend(bundled_model_path(), DEFAULT_MODEL_NAME, slots=2, n_ctx=1024)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def reference_llama() -> Iterator[llama_cpp.Llama]:
    """A plain llama-cpp-python model, for what non-streaming llama-cpp-python would answer."""
    llama = llama_cpp.Llama(model_path=str(bundled_model_path()), n_ctx=1024, verbose=False)
    yield llama
    llama.close()


def chat(max_tokens: int | None, messages: tuple[dict[str, str], ...] = COUNTING) -> GenerationRequest:
    return GenerationRequest(messages=messages, prompt=None, max_tokens=max_tokens, temperature=0.0)


async def collect(backend: LlamaBackend, request: GenerationRequest) -> list[GenerationEvent]:
    async with backend.generate(request) as events:
        return [event async for event in events]


def text_of(events: list[GenerationEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, TokenChunk))


@pytest.mark.anyio
async def test_chat_streams_tokens_then_one_finished_with_usage(backend: LlamaBackend) -> None:
    events = await collect(backend, chat(100, GREETING))
    *chunks, finished = events
    assert len(chunks) >= 3 and all(isinstance(chunk, TokenChunk) for chunk in chunks)
    assert isinstance(finished, Finished) and finished.finish_reason == "stop"
    assert "hello" in text_of(events).lower()
    assert 10 < finished.prompt_tokens < 60
    assert len(chunks) <= finished.completion_tokens < 100


@pytest.mark.anyio
@pytest.mark.parametrize(
    "request_",
    [
        chat(24, ({"role": "user", "content": "Tell me about owls."},)),
        GenerationRequest(messages=None, prompt="Owls are birds that", max_tokens=24, temperature=0.0),
    ],
    ids=["chat", "completion"],
)
async def test_text_and_usage_match_llama_cpp_without_streaming(
    backend: LlamaBackend, reference_llama: llama_cpp.Llama, request_: GenerationRequest
) -> None:
    events = await collect(backend, request_)
    reference = _answer_without_streaming(reference_llama, request_)
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert text_of(events) == _reference_text(reference)
    assert finished.prompt_tokens == reference["usage"]["prompt_tokens"]
    assert finished.completion_tokens == reference["usage"]["completion_tokens"]
    assert finished.finish_reason == reference["choices"][0]["finish_reason"]


@pytest.mark.anyio
async def test_tokens_arrive_as_they_are_produced(backend: LlamaBackend) -> None:
    arrivals: list[float] = []
    async with backend.generate(chat(40)) as events:
        async for event in events:
            arrivals.append(time.monotonic())
    # 40 tokens take ~0.3 s or more on 2 cores; a buffered stream would arrive in one burst.
    assert arrivals[-2] - arrivals[0] > 0.1
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:-1])]
    assert sum(gap > 0.001 for gap in gaps) > len(gaps) // 2


@pytest.mark.anyio
async def test_max_tokens_ends_generation_with_length(backend: LlamaBackend) -> None:
    events = await collect(backend, chat(5))
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert (finished.finish_reason, finished.completion_tokens) == ("length", 5)
    assert 1 <= len(events) - 1 <= 5


@pytest.mark.anyio
async def test_leaving_the_stream_after_three_tokens_stops_generation(backend: LlamaBackend) -> None:
    before = backend.load()
    seen = 0
    async with backend.generate(chat(None)) as events:
        async for event in events:
            seen += isinstance(event, TokenChunk)
            if seen == 3:
                left_at = time.monotonic()
                break
    assert time.monotonic() - left_at < 0.5
    await _assert_generation_stopped(backend, before, max_new_tokens=4)


@pytest.mark.anyio
async def test_cancelling_the_consumer_mid_read_stops_generation(backend: LlamaBackend) -> None:
    before = backend.load()
    seen = 0
    three_seen = anyio.Event()
    consumer_scope = anyio.CancelScope()

    async def consume() -> None:
        nonlocal seen
        with consumer_scope:
            async with contextlib.aclosing(backend.generate(chat(None))) as events:
                async for _ in events:
                    seen += 1
                    if seen == 3:
                        three_seen.set()  # no checkpoint: the next read starts before the cancel

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consume)
            await three_seen.wait()
            consumer_scope.cancel()
    assert consumer_scope.cancelled_caught
    await _assert_generation_stopped(backend, before, max_new_tokens=seen + 1)


@pytest.mark.anyio
async def test_closing_from_another_task_ends_the_readers_stream(backend: LlamaBackend) -> None:
    before = backend.load()
    events = backend.generate(chat(None))
    read: list[GenerationEvent] = []

    async def read_all() -> None:
        async for event in events:
            read.append(event)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read_all)
            while len(read) < 3:
                await anyio.sleep(0.005)
            await events.aclose()
            assert backend.load().active == 0
    assert not any(isinstance(event, Finished) and event.finish_reason != "cancelled" for event in read)
    await _assert_generation_stopped(backend, before, max_new_tokens=len(read) + 1)


@pytest.mark.anyio
async def test_two_slots_generate_concurrently_and_a_third_request_waits(backend: LlamaBackend) -> None:
    timeline: list[tuple[str, str]] = []
    first_token = {name: anyio.Event() for name in "abc"}

    async def generate(name: str) -> None:
        # a and b run long enough for c to be seen queueing behind them.
        async with backend.generate(chat(30 if name == "c" else 150)) as events:
            async for event in events:
                if not first_token[name].is_set():
                    timeline.append((name, "first token"))
                    first_token[name].set()
        timeline.append((name, "finished"))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(generate, "a")
            tasks.start_soon(generate, "b")
            await first_token["a"].wait()
            await first_token["b"].wait()
            tasks.start_soon(generate, "c")
            # c queues for a slot (the two generating threads keep waking the loop,
            # so wait for it rather than for the loop to go quiet).
            while backend.load().queued == 0 and not {("a", "finished"), ("b", "finished")} & set(timeline):
                await anyio.sleep(0.005)
            load = backend.load()
            assert (load.active, load.queued) == (2, 1)
            assert ("a", "finished") not in timeline and ("b", "finished") not in timeline
    assert {event for event in timeline[:2]} == {("a", "first token"), ("b", "first token")}
    first_finish = min(timeline.index(("a", "finished")), timeline.index(("b", "finished")))
    assert timeline.index(("c", "first token")) > first_finish
    assert (backend.load().active, backend.load().queued) == (0, 0)


@pytest.mark.anyio
async def test_prompt_longer_than_the_context_window_is_an_invalid_request(backend: LlamaBackend) -> None:
    too_long = ({"role": "user", "content": "owl " * 1500},)
    with pytest.raises(InvalidRequest) as caught:
        await collect(backend, chat(5, too_long))
    assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
    assert backend.load().active == 0
    after_the_error = await collect(backend, chat(8, GREETING))
    assert isinstance(after_the_error[-1], Finished) and text_of(after_the_error)


@pytest.mark.anyio
async def test_load_reports_a_recent_decode_rate(backend: LlamaBackend) -> None:
    await collect(backend, chat(20))
    load = backend.load()
    assert load.tokens_per_s > 0
    assert load.generations_total >= 1 and load.tokens_generated_total >= 20


async def _assert_generation_stopped(backend: LlamaBackend, before: BackendLoad, max_new_tokens: int) -> None:
    after = backend.load()
    assert after.active == 0 and after.queued == 0
    assert after.cancelled_total == before.cancelled_total + 1
    new_tokens = after.tokens_generated_total - before.tokens_generated_total
    assert 1 <= new_tokens <= max_new_tokens
    await anyio.sleep(0.3)
    assert backend.load().tokens_generated_total == after.tokens_generated_total


def _answer_without_streaming(llama: llama_cpp.Llama, request: GenerationRequest) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_tokens": request.max_tokens, "temperature": 0.0}
    if request.messages is not None:
        messages: Any = list(request.messages)
        return dict(llama.create_chat_completion(messages=messages, **sampling))  # type: ignore[arg-type]
    return dict(llama.create_completion(prompt=request.prompt or "", **sampling))  # type: ignore[arg-type]


def _reference_text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def _token(backend: LlamaBackend, text: str) -> int:
    (token,) = backend._llamas[0].tokenize(text.encode(), add_bos=False, special=False)
    return token


@pytest.mark.anyio
async def test_logit_bias_reaches_llama_cpp(backend: LlamaBackend) -> None:
    banana = _token(backend, " banana")
    forced = GenerationRequest(messages=COUNTING, prompt=None, max_tokens=12, temperature=0.0,
                               logit_bias=((banana, 100),))
    assert text_of(await collect(backend, forced)) == " banana" * 12
    banned = GenerationRequest(messages=COUNTING, prompt=None, max_tokens=12, temperature=0.0,
                               logit_bias=((_token(backend, "1"), -100),))
    assert not text_of(await collect(backend, banned)).startswith("1")


@pytest.mark.anyio
async def test_frequency_penalty_reaches_llama_cpp(backend: LlamaBackend) -> None:
    plain = text_of(await collect(backend, chat(24)))
    penalised = GenerationRequest(messages=COUNTING, prompt=None, max_tokens=24, temperature=0.0,
                                  frequency_penalty=2.0)
    assert plain.startswith("1, 2, 3, 4, 5, 6, 7, 8")
    assert text_of(await collect(backend, penalised)) != plain  # repeated ", " is penalised


def test_a_logit_bias_token_outside_the_vocabulary_is_an_invalid_request(backend: LlamaBackend) -> None:
    vocabulary = backend._llamas[0].n_vocab()
    for token in (vocabulary, 10**8):
        with pytest.raises(InvalidRequest) as caught:
            backend.generate(GenerationRequest(messages=GREETING, prompt=None, max_tokens=4,
                                               logit_bias=((token, 1),)))
        assert (caught.value.status, caught.value.param) == (400, "logit_bias")
    assert backend.load().active == 0
