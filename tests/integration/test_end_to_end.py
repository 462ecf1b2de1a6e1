"""End to end over real sockets: real processes, real TLS, the real model.

One stack (control plane, a 2-slot llama.cpp worker with the bundled SmolLM2
model, gateway) is shared by the module; tests that break things start their
own extra worker or their own small stack.
"""

from __future__ import annotations

import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from tests.support.h3client import h3_request, h3_stream_then_leave
from tests.support.stack import Stack, wait_for
from tests.support.streams import sse_data

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("stack"))
    try:
        stack.start_control_plane(lease_s=2.0)
        stack.start_worker("w-main", "--slots", "2")
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


def chat_body(content: str = "Tell me a short story about a fox.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 48, "temperature": 0, **extra}


def tls(stack: Stack) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=stack.ca_cert)


def client(stack: Stack, http2: bool = False, *, fresh: bool = True) -> httpx.Client:
    """``fresh``: ask for live generation (``cache-control: no-cache``), as most
    tests here check what the worker did; the cache has its own tests."""
    headers = {"cache-control": "no-cache"} if fresh else {}
    return httpx.Client(base_url=stack.gateway_url, verify=tls(stack), http2=http2,
                        http1=not http2, timeout=60, headers=headers)


def read_sse(response: httpx.Response) -> list[tuple[float, str]]:
    """(arrival time, data) per SSE event, as the bytes arrive."""
    events: list[tuple[float, str]] = []
    buffer = b""
    for data in response.iter_raw():
        buffer += data
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.decode().splitlines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line[6:]))
    return events


def assert_streamed_tokens(events: list[tuple[float, str]]) -> str:
    assert events[-1][1] == "[DONE]"
    chunks = [orjson.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) >= 5, "the answer came as several token chunks"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # No buffering: tokens trickle in as the model produces them (~140 tok/s here).
    spread = events[-2][0] - events[0][0]
    assert spread > 0.05, f"all chunks arrived within {spread * 1000:.1f} ms: buffered"
    return "".join(c["choices"][0]["delta"]["content"] for c in content)


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
def test_streaming_chat_over_tcp(stack: Stack, http2: bool) -> None:
    with client(stack, http2) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            assert response.status_code == 200
            assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-hedgerow-worker"] == "w-main"
            assert len(response.headers["x-request-id"]) >= 16
            assert f'h3=":{stack.gateway_port}"' in response.headers["alt-svc"]
            text = assert_streamed_tokens(read_sse(response))
    assert text.strip()


@pytest.mark.anyio
async def test_streaming_chat_over_http3(stack: Stack) -> None:
    body = orjson.dumps(chat_body(stream=True))
    response = await h3_request(
        "127.0.0.1", stack.gateway_port, "POST", "/v1/chat/completions",
        headers=[("content-type", "application/json"), ("cache-control", "no-cache")],
        body=body,
        cafile=stack.ca_cert, server_name="localhost", timeout_s=60,
    )
    assert response.status == 200
    assert response.alpn_protocol == "h3"
    assert response.header("x-hedgerow-worker") == "w-main"
    events: list[tuple[float, str]] = []
    buffer = b""
    for chunk in response.chunks:
        buffer += chunk.data
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            events += [(chunk.received_at, data) for data in sse_data(block.decode())]
    assert_streamed_tokens(events)


@pytest.mark.anyio
async def test_openai_sdk_streams_a_completion(stack: Stack) -> None:
    import openai

    sdk = openai.AsyncOpenAI(
        base_url=stack.gateway_url + "/v1", api_key="sk-demo",
        http_client=openai.DefaultAsyncHttpxClient(verify=tls(stack)),
    )
    async with sdk:
        stream = await sdk.chat.completions.create(
            model=MODEL, stream=True, max_tokens=32, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert len(parts) >= 3 and "".join(parts).strip()
        assert usage is not None and usage.completion_tokens >= len(parts) - 1
        listed = await sdk.models.list()
        assert MODEL in [m.id for m in listed.data]


@pytest.mark.anyio
async def test_openai_sdk_logit_bias_and_penalties_reach_the_model(stack: Stack) -> None:
    """Carried, not dropped: a +100 bias makes the real model say one token only."""
    import llama_cpp
    import openai

    from workers.models import bundled_model_path

    vocab = llama_cpp.Llama(model_path=str(bundled_model_path()), vocab_only=True, verbose=False)
    (banana,) = vocab.tokenize(b" banana", add_bos=False, special=False)
    count = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
    sdk = openai.AsyncOpenAI(
        base_url=stack.gateway_url + "/v1", api_key="sk-demo", max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(verify=tls(stack),
                                                   headers={"cache-control": "no-cache"}),
    )
    async with sdk:
        async def answer(max_tokens: int = 10, **fields: Any) -> str:
            done = await sdk.chat.completions.create(model=MODEL, messages=count, temperature=0,
                                                     max_tokens=max_tokens, **fields)
            return done.choices[0].message.content or ""

        assert await answer(logit_bias={str(banana): 100}) == " banana" * 10
        plain = await answer(24)
        assert plain.startswith("1, 2, 3, 4, 5, 6, 7, 8")
        assert await answer(24, frequency_penalty=2.0) != plain  # repeated ", " penalised
        text = await sdk.completions.create(model=MODEL, prompt="My favourite fruit is",
                                            max_tokens=5, temperature=0,
                                            logit_bias={str(banana): 100})
        assert text.choices[0].text == " banana" * 5
        with pytest.raises(openai.BadRequestError) as outside:
            await answer(logit_bias={str(vocab.n_vocab()): 5})  # the worker knows the vocabulary
        assert outside.value.status_code == 400


def test_non_streaming_chat_returns_one_completion(stack: Stack) -> None:
    with client(stack) as http:
        response = http.post("/v1/chat/completions", json=chat_body(max_tokens=8))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] > 5


def test_a_repeated_deterministic_request_is_an_exact_cache_hit(stack: Stack) -> None:
    body = chat_body("Name one colour of a hedge.", max_tokens=12, stream=True)
    with client(stack, fresh=False) as http:
        live = http.post("/v1/chat/completions", json=body)
        before = stack.worker_status("w-main")
        cached = http.post("/v1/chat/completions", json=body)
        after = stack.worker_status("w-main")
    assert live.headers["x-hedgerow-cache"] == "miss"
    assert cached.headers["x-hedgerow-cache"] == "exact"
    assert after["generations_total"] == before["generations_total"]
    assert sse_data(cached.text)[-1] == "[DONE]"
    text = [orjson.loads(d)["choices"][0]["delta"].get("content") or ""
            for d in sse_data(cached.text)[:-1] if orjson.loads(d)["choices"]]
    live_text = [orjson.loads(d)["choices"][0]["delta"].get("content") or ""
                 for d in sse_data(live.text)[:-1] if orjson.loads(d)["choices"]]
    assert "".join(text) == "".join(live_text) != ""


def test_text_completion_and_model_alias(stack: Stack) -> None:
    with client(stack) as http:
        response = http.post("/v1/completions",
                             json={"model": "smollm2", "prompt": "One, two, three,",
                                   "max_tokens": 6, "temperature": 0})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"]


def test_health_readiness_and_page(stack: Stack) -> None:
    with client(stack) as http:
        assert http.get("/healthz").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["workers"] >= 1
        page = http.get("/")
        assert page.status_code == 200 and "/v1/chat/completions" in page.text


RESUME_GRACE_S = 5.0  # policies/default.yaml streams.resume_grace_ms


def _read_events(chunks: Iterator[bytes], count: int) -> bytes:
    """The raw bytes of the first ``count`` whole SSE events (a few bytes more may be read)."""
    raw = b""
    for data in chunks:
        raw += data
        if raw.count(b"\n\n") >= count:
            break
    return raw[: _nth_event_end(raw, count)]


def _nth_event_end(raw: bytes, count: int) -> int:
    end = 0
    for _ in range(count):
        end = raw.index(b"\n\n", end) + 2
    return end


def _text_of(raw: bytes) -> str:
    pieces = []
    for block in raw.decode().strip().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                pieces += [c["text"] for c in chunk.get("choices") or []]
    return "".join(pieces)


def _settled_after(stack: Stack, before: dict[str, Any], timeout: float) -> dict[str, Any]:
    def settled() -> dict[str, Any] | None:
        status = stack.worker_status("w-main")
        return status if status["active"] == 0 and status["cancelled_total"] > before["cancelled_total"] else None

    return wait_for(settled, "the worker to cancel the generation", timeout=timeout)  # type: ignore[no-any-return]


def test_client_disconnect_stops_generation_after_the_resume_grace(stack: Stack) -> None:
    before = stack.worker_status("w-main")
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000,
            "temperature": 0, "stream": True}
    with client(stack) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            _read_events(response.iter_raw(), 5)
    left = time.monotonic()
    # The client went away after a few tokens: the generation waits for it to
    # resume for the grace, then the worker stops within a token or so.
    status = _settled_after(stack, before, timeout=RESUME_GRACE_S + 5)
    assert time.monotonic() - left >= RESUME_GRACE_S - 1.0
    time.sleep(0.5)
    later = stack.worker_status("w-main")
    assert later["tokens_generated_total"] == status["tokens_generated_total"]
    generated = status["tokens_generated_total"] - before["tokens_generated_total"]
    assert generated < 2000, "the generation ran to max_tokens for a client that left"


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["reset", "close"])
async def test_an_http3_client_that_leaves_stops_generation_after_the_resume_grace(
        stack: Stack, how: str) -> None:
    # Hypercorn does not tell an HTTP/3 request that its client left: a stream
    # reset (a browser's abort) or a closed QUIC connection used to leave the
    # generation running to max_tokens (gateway.edge.quic_cap, _client_left).
    before = stack.worker_status("w-main")
    body = orjson.dumps({"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000,
                         "temperature": 0, "stream": True})
    response = await h3_stream_then_leave(
        "127.0.0.1", stack.gateway_port, "/v1/completions",
        [("content-type", "application/json"), ("cache-control", "no-cache")], body,
        cafile=stack.ca_cert, server_name="localhost", read_bytes=600, how=how)
    assert response.status == 200 and len(response.body) >= 600
    left = time.monotonic()
    status = await anyio.to_thread.run_sync(_settled_after, stack, before, RESUME_GRACE_S + 5)
    assert time.monotonic() - left >= RESUME_GRACE_S - 1.0
    generated = status["tokens_generated_total"] - before["tokens_generated_total"]
    assert generated < 2000, "the generation ran to max_tokens for a client that left"


def test_cancel_stops_the_generation_at_once(stack: Stack) -> None:
    before = stack.worker_status("w-main")
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000,
            "temperature": 0, "stream": True}
    with client(stack) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            chunks = response.iter_raw()
            _read_events(chunks, 5)
            request_id = response.headers["x-request-id"]
            cancelled = http.post(f"/v1/completions/{request_id}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
            rest = b"".join(chunks)
    assert b'"code":"stream_cancelled"' in rest
    status = _settled_after(stack, before, timeout=3)
    generated = status["tokens_generated_total"] - before["tokens_generated_total"]
    assert generated < 400, f"{generated} tokens generated for a cancelled stream"


def test_a_cut_stream_resumes_with_last_event_id_and_matches_an_uninterrupted_one(
        stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "The fox and the hedge:", "max_tokens": 60,
            "temperature": 0, "stream": True}
    with client(stack) as http:
        before = stack.worker_status("w-main")
        with http.stream("POST", "/v1/completions", json=body) as response:
            head = _read_events(response.iter_raw(), 6)
            request_id = response.headers["x-request-id"]
        last_id = int(head.decode().strip().split("\n\n")[-1].split("\n")[0][len("id: "):])
        resumed = http.get(f"/v1/completions/{request_id}/events",
                           headers={"last-event-id": str(last_id)})
        # The same generation read without interruption, from its first event.
        whole = http.get(f"/v1/completions/{request_id}/events")
        after = stack.worker_status("w-main")
    assert resumed.status_code == 200
    assert resumed.text.startswith(f"id: {last_id + 1}\n")
    assert resumed.text.rstrip().endswith("data: [DONE]")
    assert head + resumed.content == whole.content
    assert len(_text_of(head)) > 0 and len(_text_of(resumed.content)) > 0
    # Generated once: the worker ran one generation for the cut request and both reads.
    assert after["generations_total"] - before["generations_total"] == 1


def test_killed_worker_leaves_the_registry_and_traffic_moves(stack: Stack) -> None:
    doomed = stack.start_worker("w-doomed")
    doomed.stop(signal.SIGKILL)
    # Until its lease runs out the gateway may still pick it: that attempt fails
    # before any byte reached the client and is retried on w-main, invisibly.
    with client(stack) as http:
        for _ in range(3):
            response = http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            assert response.status_code == 200
            assert response.headers["x-hedgerow-worker"] == "w-main"
    wait_for(lambda: stack.worker("w-doomed") is None, "the lease of w-doomed to expire", 6)


def test_worker_drains_and_deregisters_on_sigterm(stack: Stack) -> None:
    leaving = stack.start_worker("w-leaving")
    assert leaving.stop(signal.SIGTERM) == 0
    assert stack.worker("w-leaving") is None, "deregistered at once, not after its lease"
    assert "deregistered" in leaving.log()


# -- bad input ------------------------------------------------------------

BAD_INPUTS = [
    ("malformed json", b'{"model": ', {}, 400, "invalid_request_error"),
    ("wrong type", orjson.dumps(chat_body(temperature="hot")), {}, 400, "invalid_request_error"),
    ("missing messages", orjson.dumps({"model": MODEL}), {}, 400, "invalid_request_error"),
    ("unknown model", orjson.dumps(chat_body() | {"model": "gpt-9"}), {}, 404,
     "invalid_request_error"),
    ("too large", orjson.dumps(chat_body("x" * 2_000_000)), {}, 413, "invalid_request_error"),
    ("bad api key", orjson.dumps(chat_body()), {"authorization": "Bearer nope"}, 401,
     "authentication_error"),
    ("not json", b"hello", {"content-type": "text/plain"}, 415, "invalid_request_error"),
    ("max_tokens over limit", orjson.dumps(chat_body(max_tokens=100_000)), {}, 400,
     "invalid_request_error"),
]


@pytest.mark.parametrize("name, body, headers, status, error_type", BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_an_openai_error(stack: Stack, name: str, body: bytes,
                                        headers: dict[str, str], status: int,
                                        error_type: str) -> None:
    headers = {"content-type": "application/json", **headers}
    with client(stack) as http:
        response = http.post("/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and error["message"] and error["code"]
    assert response.headers["x-request-id"]


def test_wrong_method_and_unknown_path(stack: Stack) -> None:
    with client(stack) as http:
        assert http.get("/v1/chat/completions").status_code == 405
        missing = http.get("/v2/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_no_healthy_worker_is_503_with_retry_after(tmp_path: Path) -> None:
    empty = Stack(tmp_path)
    try:
        empty.start_control_plane()
        empty.start_gateway(wait_ready=False)
        with httpx.Client(base_url=empty.gateway_url, verify=tls(empty)) as http:
            # The control plane's policy arrives (before it: 503 policy_unavailable).
            wait_for(lambda: http.get("/readyz").json()["policy"], "the policy", 10)
            assert http.get("/readyz").status_code == 503
            response = http.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 503
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "no_healthy_worker"
    finally:
        empty.stop_all()
