"""The simulated worker over real sockets: its HTTP behaviour, then through a whole stack.

First a worker app with a ``SimBackend`` served in-process on 127.0.0.1:0 (how
failures look on the wire), then real processes — control plane, three sim
workers (`hedgerow worker --backend sim`) serving a healthy, an always-failing
and an always-breaking model, and a gateway — to see what a client of the
gateway gets in each case.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import orjson
import pytest

from hedgerow.serving import serve_internal
from tests.support.stack import Stack
from workers.app import WorkerApp, WorkerState
from workers.sim_backend import LatencyModel, SimBackend

MODEL = "smollm2-135m-instruct"
FAST: dict[str, Any] = {"prefill_ms_per_token": 0.1, "decode_ms_per_token": 2.0}


def chat_body(model: str = MODEL, max_tokens: int = 8, stream: bool = True) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me about foxes."}],
            "max_tokens": max_tokens, "stream": stream}


def sse_data(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


# -- the worker app alone ---------------------------------------------------


@asynccontextmanager
async def sim_worker(latency: LatencyModel, slots: int = 1) -> AsyncIterator[tuple[str, SimBackend]]:
    backend = SimBackend(MODEL, slots, latency, rng_seed=1)
    app = WorkerApp(backend, WorkerState(worker_id="sim-test"))
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_internal, app, "127.0.0.1", 0, stop)
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_until_serving(url)
            yield url, backend
        finally:
            stop.set()


async def wait_until_serving(url: str) -> None:
    """The port is bound before Hypercorn accepts on it."""
    async with httpx.AsyncClient() as client:
        with anyio.fail_after(10):
            while True:
                try:
                    await client.get(url + "/healthz")
                    return
                except httpx.ConnectError:
                    await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_worker_streams_simulated_tokens_as_openai_chunks() -> None:
    async with sim_worker(LatencyModel(**FAST)) as (url, _), httpx.AsyncClient() as client:
        response = await client.post(url + "/v1/chat/completions", json=chat_body(max_tokens=3))
    assert response.status_code == 200
    events = sse_data(response.content)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "tok1 tok2 tok3 "
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_n_choices_from_the_worker_whole_and_streamed() -> None:
    async with sim_worker(LatencyModel(**FAST)) as (url, backend), httpx.AsyncClient() as client:
        whole = await client.post(url + "/v1/chat/completions",
                                  json={**chat_body(max_tokens=2, stream=False), "n": 2})
        streamed = await client.post(url + "/v1/chat/completions", json={
            **chat_body(max_tokens=2), "n": 2, "stream_options": {"include_usage": True}})
        assert backend.load().active == 0
    body = whole.json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "tok1 tok2 ", "length"), (1, "tok1 tok2 ", "length")]
    assert body["usage"]["completion_tokens"] == 4
    chunks = [orjson.loads(e) for e in sse_data(streamed.content)[:-1]]
    finishes = [c["choices"][0]["index"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]]
    roles = [c["choices"][0]["index"] for c in chunks
             if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert finishes == [0, 1] and roles == [0, 1]
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [4]


@pytest.mark.anyio
async def test_the_simulated_worker_refuses_what_it_cannot_honour() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    async with sim_worker(LatencyModel(**FAST)) as (url, _), httpx.AsyncClient() as client:
        response = await client.post(url + "/v1/chat/completions",
                                     json={**chat_body(), "tools": tools})
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (
        "unsupported_parameter", "tools")


@pytest.mark.anyio
async def test_failure_before_first_token_is_a_500_even_when_streaming() -> None:
    async with sim_worker(LatencyModel(**FAST, failure_probability=1.0)) as (url, backend), \
            httpx.AsyncClient() as client:
        response = await client.post(url + "/v1/chat/completions", json=chat_body())
        assert backend.load().active == 0
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "simulated_failure"


@pytest.mark.anyio
async def test_mid_stream_failure_cuts_the_response() -> None:
    latency = LatencyModel(**FAST, mid_stream_failure_probability=1.0)
    received = b""
    async with sim_worker(latency) as (url, backend), httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", url + "/v1/chat/completions", json=chat_body()) as response:
                assert response.status_code == 200
                async for data in response.aiter_raw():
                    received += data
        assert backend.load().active == 0
    events = sse_data(received)
    assert any("tok1 " in e for e in events), "some tokens arrived before the break"
    assert "[DONE]" not in events


@pytest.mark.anyio
async def test_caller_leaving_before_the_first_token_frees_the_slot() -> None:
    slow_prefill = LatencyModel(prefill_ms_per_token=60_000.0, decode_ms_per_token=1.0)
    async with sim_worker(slow_prefill) as (url, backend), httpx.AsyncClient() as client:
        with anyio.move_on_after(0.3):
            await client.post(url + "/v1/chat/completions", json=chat_body())
        with anyio.fail_after(5):
            while backend.load().active:
                await anyio.sleep(0.01)
        assert backend.load().cancelled_total == 1


# -- through the gateway ----------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("sim-stack"))
    fast = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "5"]
    try:
        stack.start_control_plane(lease_s=2.0)
        stack.start_worker("sim-ok", *fast, "--slots", "4")
        stack.start_worker("sim-fail", *fast, "--model-name", "sim-fail", "--sim-fail-prob", "1")
        stack.start_worker("sim-break", *fast, "--model-name", "sim-break",
                           "--sim-midstream-fail-prob", "1")
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


def gateway(stack: Stack, http2: bool = False) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, http2=http2, http1=not http2, timeout=30,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def test_sim_worker_registers_as_kind_sim(stack: Stack) -> None:
    registration = stack.worker("sim-ok")["registration"]  # type: ignore[index]
    assert (registration["kind"], registration["models"], registration["slots"]) == ("sim", [MODEL], 4)


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_chat_streams_through_the_gateway_from_a_sim_worker(stack: Stack, http2: bool) -> None:
    with gateway(stack, http2) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=6)) as response:
            assert response.status_code == 200
            assert response.headers["x-hedgerow-worker"] == "sim-ok"
            events = sse_data(response.read())
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        "tok1 tok2 tok3 tok4 tok5 tok6 "


def test_worker_failing_before_first_token_gives_a_503_envelope(stack: Stack) -> None:
    with gateway(stack) as client:
        response = client.post("/v1/chat/completions", json=chat_body("sim-fail"))
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "service_unavailable"
    # What failed, in Hedgerow's words: never the worker's id, address or body.
    assert error["message"] == ("no worker could serve the request: "
                                "the model server answered with an error")
    assert "retry-after" in response.headers


def test_worker_breaking_mid_stream_ends_with_an_sse_error_event(stack: Stack) -> None:
    with gateway(stack) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat_body("sim-break")) as response:
            assert response.status_code == 200
            events = sse_data(response.read())
    assert "[DONE]" not in events
    assert any("tok1 " in e for e in events[:-1]), "tokens before the break were relayed"
    last = orjson.loads(events[-1])
    assert set(last) == {"error"}
    assert last["error"]["type"] == "upstream_error"
