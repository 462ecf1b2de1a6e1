"""Worker efficiency with the real bundled SmolLM2-135M: prompt reuse, prompt-lookup
decoding, warm start before registration, quantization variants."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from hedgerow.asgi import Request, Router, send_json
from hedgerow.serving import serve_internal
from tests.support.stack import free_port
from workers.backend import Finished, GenerationRequest, TokenChunk
from workers.llama_backend import LlamaBackend
from workers.main import WorkerOptions, run_worker
from workers.models import DEFAULT_MODEL_NAME, bundled_model_path, model_variant_path

SYSTEM = {"role": "system", "content": "You are a terse assistant for a garden shop. " * 6}
# A completion whose answer copies its input: what prompt-lookup decoding is for.
EXTRACT = ("Records:\nid=17 | Ada Park | Berlin | ada@example.org\n"
           "id=23 | Bo Jensen | Oslo | bo@example.org\nid=31 | Cy Moreau | Lyon | cy@example.org\n"
           "\nThe same records again:\nid=17 |")
# One thread a slot: the test machine's cores are shared, and llama.cpp's
# threads spin-wait, so more threads than free cores is many times slower.
THREADS = 1


def llama(slots: int = 1, n_ctx: int = 1024, **options: Any) -> LlamaBackend:
    return LlamaBackend(bundled_model_path(), DEFAULT_MODEL_NAME, slots=slots, n_ctx=n_ctx,
                        n_threads=THREADS, **options)


def chat(messages: list[dict[str, str]], max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(messages=tuple(messages), prompt=None, max_tokens=max_tokens,
                             temperature=0.0, seed=0)


async def answer(backend: LlamaBackend, request: GenerationRequest) -> tuple[str, Finished]:
    parts: list[str] = []
    async with backend.generate(request) as events:
        async for event in events:
            if isinstance(event, TokenChunk):
                parts.append(event.text)
            else:
                return "".join(parts), event
    raise AssertionError("no Finished event")


@pytest.fixture(scope="module")
def two_slots() -> Iterator[LlamaBackend]:
    backend = llama(slots=2)
    yield backend
    backend.close()


# -- prompt reuse ---------------------------------------------------------------------


async def turn(backend: LlamaBackend, history: list[dict[str, str]], text: str) -> tuple[int, int]:
    """Ask ``text`` in ``history``; (its prompt tokens, the prompt tokens it reused)."""
    before = backend.load()
    history.append({"role": "user", "content": text})
    reply, finished = await answer(backend, chat(history))
    history.append({"role": "assistant", "content": reply})
    reused = backend.load().prompt_tokens_reused_total - before.prompt_tokens_reused_total
    return finished.prompt_tokens, reused


@pytest.mark.anyio
async def test_next_turn_reuses_its_conversation_slot_even_when_another_is_free_longer(
    two_slots: LlamaBackend,
) -> None:
    roses = [dict(SYSTEM)]
    ferns = [{"role": "system", "content": "You answer questions about ferns only. " * 6}]
    roses_prompt, _ = await turn(two_slots, roses, "Do roses need sun?")
    ferns_prompt, _ = await turn(two_slots, ferns, "Do ferns need shade?")
    # A plain FIFO pool would hand the ferns' next turn the roses' slot (free the longest).
    _, ferns_reused = await turn(two_slots, ferns, "And water?")
    _, roses_reused = await turn(two_slots, roses, "And pruning?")
    assert ferns_reused >= ferns_prompt - 1
    assert roses_reused >= roses_prompt - 1
    load = two_slots.load()
    assert load.prompt_cache_hits_total >= 2
    assert load.prompt_tokens_reused_total <= load.prompt_tokens_total


@pytest.mark.anyio
async def test_without_reuse_every_prompt_is_evaluated_in_full() -> None:
    backend = llama(prompt_reuse=False)
    try:
        history = [dict(SYSTEM)]
        await turn(backend, history, "Do roses need sun?")
        _, reused = await turn(backend, history, "And pruning?")
        load = backend.load()
    finally:
        backend.close()
    assert reused == 0
    assert (load.prompt_cache_hits_total, load.prompt_cache_misses_total) == (0, 2)


# -- prompt-lookup decoding -------------------------------------------------------------


@pytest.mark.anyio
async def test_prompt_lookup_drafts_from_the_prompt_and_counts_accepted_tokens() -> None:
    plain, lookup = llama(), llama(prompt_lookup_tokens=8)
    request = GenerationRequest(messages=None, prompt=EXTRACT, max_tokens=40, temperature=0.0)
    try:
        expected, _ = await answer(plain, request)
        got, finished = await answer(lookup, request)
        load = lookup.load()
    finally:
        plain.close()
        lookup.close()
    assert got == expected  # greedy decoding: drafts change the speed, never the text
    assert "Bo Jensen | Oslo | bo@example.org" in got
    assert load.draft_tokens_total > 0
    assert 0 < load.draft_tokens_accepted_total <= load.draft_tokens_total
    assert load.draft_tokens_accepted_total < finished.completion_tokens


# -- warm start -----------------------------------------------------------------------


class GatedBackend(LlamaBackend):
    """Its warm-up waits for the test to open the gate."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(bundled_model_path(), DEFAULT_MODEL_NAME, slots=1, n_ctx=512,
                         n_threads=THREADS)
        self.gate = gate
        self.warmed = False

    def warm_up(self) -> None:
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        super().warm_up()
        self.warmed = True


def control_plane(registrations: list[dict[str, Any]]) -> Router:
    """Just enough control plane for a worker: register, heartbeat, leave."""
    router = Router()

    async def register(request: Request) -> None:
        registrations.append(orjson.loads(await request.body(1 << 20)))
        await send_json(request.send, 200, {"worker_id": "w", "lease_s": 3.0,
                                            "heartbeat_interval_s": 1.0})

    async def ok(request: Request) -> None:
        await send_json(request.send, 200, {})

    router.add("POST", "/v1/workers", register)
    router.add("POST", "/v1/workers/{worker_id}/heartbeat", ok)
    router.add("DELETE", "/v1/workers/{worker_id}", ok)
    return router



@pytest.mark.anyio
async def test_worker_registers_only_after_its_warm_up_and_refuses_work_until_then() -> None:
    gate = threading.Event()
    backend = GatedBackend(gate)
    registrations: list[dict[str, Any]] = []
    router = control_plane(registrations)
    port = free_port()
    stop_cp, shutdown = anyio.Event(), anyio.Event()
    try:
        async with anyio.create_task_group() as tg, httpx.AsyncClient() as client:
            cp_port = await tg.start(serve_internal, router.serve, "127.0.0.1", 0, stop_cp)
            options = WorkerOptions(control_plane=f"http://127.0.0.1:{cp_port}", port=port,
                                    tier="fast", drain_timeout_s=1)
            async with anyio.create_task_group() as worker:  # ends once the worker has left
                worker.start_soon(run_worker, options, backend, shutdown)
                await check_warm_start(client, f"http://127.0.0.1:{port}", gate, backend,
                                       registrations)
                shutdown.set()
            stop_cp.set()
    finally:
        gate.set()
        backend.close()


async def check_warm_start(client: httpx.AsyncClient, url: str, gate: threading.Event,
                           backend: GatedBackend, registrations: list[dict[str, Any]]) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}
    with anyio.fail_after(20):
        while True:  # the server answers while the model warms up
            try:
                warming = await client.get(url + "/readyz")
                break
            except httpx.ConnectError:
                await anyio.sleep(0.02)
    assert warming.status_code == 503 and warming.json()["warming"] is True
    refused = await client.post(url + "/v1/chat/completions", json=body)
    assert refused.status_code == 503
    await anyio.sleep(1.5)  # more than a heartbeat tick: still not registered
    assert registrations == [] and not backend.warmed
    gate.set()
    with anyio.fail_after(20):
        while not registrations:
            await anyio.sleep(0.02)
    assert backend.warmed  # registered only once warm
    assert registrations[0]["labels"]["tier"] == "fast"
    assert (await client.get(url + "/readyz")).status_code == 200
    served = await client.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert served.status_code == 200


def test_warm_up_leaves_no_counted_generation_and_an_empty_slot() -> None:
    backend = llama(n_ctx=512)
    try:
        backend.warm_up()
        load = backend.load()
    finally:
        backend.close()
    assert (load.generations_total, load.tokens_generated_total, load.prompt_tokens_total) == (0, 0, 0)


# -- quantization variants ---------------------------------------------------------


@pytest.mark.anyio
async def test_a_q8_variant_is_made_once_from_the_bundled_model_and_serves(tmp_path: Path) -> None:
    path = model_variant_path("q8_0", cache_dir=tmp_path)
    assert path.parent == tmp_path and path.name.endswith(".Q8_0.gguf")
    assert path.stat().st_size > bundled_model_path().stat().st_size  # 8 bits a weight, not 4.5
    made_at = path.stat().st_mtime_ns
    assert model_variant_path("q8_0", cache_dir=tmp_path).stat().st_mtime_ns == made_at
    assert model_variant_path("q4_1", cache_dir=tmp_path) == bundled_model_path()
    backend = LlamaBackend(path, DEFAULT_MODEL_NAME, slots=1, n_ctx=512, n_threads=THREADS)
    try:
        text, finished = await answer(backend, chat([{"role": "user", "content": "Say hi."}]))
    finally:
        backend.close()
    assert text and finished.completion_tokens > 0
