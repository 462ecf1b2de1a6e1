"""``POST /v1/messages`` through the real gateway app, over fake OpenAI-shaped workers.

The scheduler, dispatcher, relay and cache are the real ones; the workers are
``tests.support.fake_workers`` twins. So these check that an Anthropic request
reaches a worker as the equivalent chat request, and that what the worker
streams (text, tool calls, failures) reaches the client in Anthropic's shapes.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from hedgerow import openai_api as oa
from hedgerow.asgi import SSE_DONE, sse_event
from tests.integration.test_resumable_streams import gateway, until
from tests.support.asgi_client import Client, Gateway
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio

TOKENS = ("Hello", ",", " world")
KEY = [(b"x-api-key", b"key-u"), (b"anthropic-version", b"2023-06-01")]


def ask(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "max_tokens": 16, "system": "Be brief.",
                         "messages": [{"role": "user", "content": "Hi"}], **fields})


async def post(gw: Gateway, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
               ) -> Client:
    client = gw.start(Client("POST", "/v1/messages", body, headers=[
        (b"content-type", b"application/json"), *(KEY if headers is None else headers)]))
    await until(client.finished.is_set)
    return client


def events(client: Client) -> list[tuple[str, dict[str, Any]]]:
    return [(e.event or "", orjson.loads(e.data)) for e in client.events()]


async def test_a_message_reaches_the_worker_as_the_same_chat_request() -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        client = await post(gw, ask(stop_sequences=["\n\n"], temperature=0.5))
        assert client.status == 200
        assert client.json() == {
            "id": "msg_" + client.header("x-request-id"), "type": "message",
            "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": "Hello, world"}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 7, "output_tokens": 3}}
        assert int(client.header("content-length")) == len(client.raw())
        (call,) = gw.workers.calls
        assert call.body["messages"] == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}]
        assert (call.body["max_tokens"], call.body["stop"], call.body["temperature"]) == (
            16, ["\n\n"], 0.5)


async def test_a_streamed_message_is_anthropics_event_sequence() -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        client = await post(gw, ask(stream=True))
    out = events(client)
    assert client.status == 200 and client.header("content-type").startswith("text/event-stream")
    assert [name for name, _ in out] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert "".join(p["delta"]["text"] for n, p in out if n == "content_block_delta") == \
        "Hello, world"
    assert out[-2][1]["usage"] == {"input_tokens": 7, "output_tokens": 3}


def tool_call_stream(rid: str = "r") -> bytes:
    chunks = [
        oa.chat_chunk(rid, "m", 0, {"role": "assistant", "content": "Let me check."}),
        oa.chat_chunk(rid, "m", 0, {"tool_calls": [{
            "index": 0, "id": "call_7", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": "}}]}),
        oa.chat_chunk(rid, "m", 0, {"tool_calls": [{
            "index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
        oa.chat_chunk(rid, "m", 0, {}, "tool_calls"),
        oa.usage_chunk(rid, "m", 0, oa.usage(9, 12)),
    ]
    return b"".join(sse_event(c) for c in chunks) + SSE_DONE


async def test_a_streamed_tool_call_is_a_tool_use_block_with_json_deltas() -> None:
    async with gateway(Behaviour(body=tool_call_stream())) as gw:
        client = await post(gw, ask(stream=True))
    out = events(client)
    starts = [p["content_block"] for n, p in out if n == "content_block_start"]
    assert starts == [{"type": "text", "text": ""},
                      {"type": "tool_use", "id": "toolu_call_7", "name": "get_weather",
                       "input": {}}]
    partial = "".join(p["delta"]["partial_json"] for n, p in out
                      if n == "content_block_delta" and p["delta"]["type"] == "input_json_delta")
    assert orjson.loads(partial) == {"city": "Paris"}
    assert out[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


async def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event() -> None:
    async with gateway(Behaviour(tokens=TOKENS, break_after_tokens=2)) as gw:
        client = await post(gw, ask(stream=True))
    out = events(client)
    assert out[0][0] == "message_start" and "message_stop" not in [n for n, _ in out]
    assert out[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "the model server could not be reached"}})


@pytest.mark.parametrize("stream", [False, True])
async def test_no_worker_is_anthropics_529_overloaded_with_retry_after(stream: bool) -> None:
    async with gateway(Behaviour(status=500)) as gw:
        client = await post(gw, ask(stream=stream))
    assert client.status == 529 and int(client.header("retry-after")) >= 1
    body = client.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert body["request_id"] == client.header("x-request-id")


@pytest.mark.parametrize("headers, status, kind", [
    ([(b"x-api-key", b"wrong")], 401, "authentication_error"),
    ([(b"authorization", b"Bearer wrong")], 401, "authentication_error"),
    ([(b"authorization", b"Bearer key-u")], 200, None),
    ([(b"x-api-key", b"key-u"), (b"anthropic-version", b"2023-01-01")], 400,
     "invalid_request_error"),
])
async def test_keys_and_versions(headers: list[tuple[bytes, bytes]], status: int,
                                 kind: str | None) -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        client = await post(gw, ask(), headers)
    assert client.status == status
    if kind is not None:
        assert client.json()["error"]["type"] == kind


async def test_a_bad_field_is_anthropics_invalid_request_error() -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        client = await post(gw, ask(top_k=3))
        missing = await post(gw, orjson.dumps({"model": "m", "messages": [
            {"role": "user", "content": "Hi"}]}))
        assert gw.workers.calls == []
    assert client.status == 400 and client.json()["error"] == {
        "type": "invalid_request_error",
        "message": "Hedgerow does not support 'top_k' with this value "
                   "(the workers' OpenAI sampling has no top_k)"}
    assert missing.status == 400  # max_tokens is required, as Anthropic's is
    assert missing.json()["error"]["message"] == "invalid value for 'max_tokens': Field required"


async def test_a_cached_answer_serves_both_apis() -> None:
    async with gateway(Behaviour(tokens=TOKENS), cache={"enabled": True,
                                                        "semantic": {"enabled": False}}) as gw:
        first = await post(gw, ask(temperature=0))
        again = await post(gw, ask(temperature=0, stream=True))
        assert len(gw.workers.calls) == 1
    assert again.header("x-hedgerow-cache") == "exact"
    text = "".join(p["delta"]["text"] for n, p in events(again) if n == "content_block_delta")
    assert text == first.json()["content"][0]["text"] == "Hello, world"
