"""Anthropic's Messages API onto the chat path and back: requests, answers, streams, errors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from hedgerow import anthropic_api, anthropic_reply
from hedgerow.anthropic_reply import MessageStream, message_of
from hedgerow.errors import (
    AnthropicShaped,
    AuthenticationFailed,
    GatewayDraining,
    InvalidRequest,
    ModelNotFound,
    NoHealthyWorker,
    RateLimited,
    UpstreamFailed,
)
from hedgerow.sse import SseParser

USER = {"role": "user", "content": "hi"}


def translate(**fields: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 16, "messages": [USER], **fields}
    return anthropic_api.openai_request(orjson.dumps(body))


def refusal(**fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        translate(**fields)
    assert caught.value.status == 400
    return caught.value


# -- requests ---------------------------------------------------------------------------

def test_a_plain_request_becomes_the_same_chat_request() -> None:
    assert translate(system="Be brief.", temperature=0.0, top_p=0.9, stop_sequences=["\n\n"],
                     metadata={"user_id": "u-1"}) == {
        "model": "m", "max_tokens": 16, "stream": False, "temperature": 0.0, "top_p": 0.9,
        "stop": ["\n\n"], "user": "u-1",
        "messages": [{"role": "system", "content": "Be brief."}, USER]}


def test_system_blocks_and_text_blocks_are_joined_a_line_each() -> None:
    out = translate(system=[{"type": "text", "text": "A."}, {"type": "text", "text": "B.",
                                                             "cache_control": {"type": "ephemeral"}}],
                    messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                           {"type": "text", "text": "y"}]}])
    assert out["messages"] == [{"role": "system", "content": "A.\nB."},
                               {"role": "user", "content": "x\ny"}]


def test_a_stream_always_asks_the_chat_path_for_usage() -> None:
    out = translate(stream=True)
    assert out["stream"] is True and out["stream_options"] == {"include_usage": True}


TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


@pytest.mark.parametrize("choice, openai", [
    ({"type": "auto"}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tools_and_tool_choice_become_openai_function_tools(choice: dict[str, Any],
                                                            openai: Any) -> None:
    out = translate(tools=[TOOL], tool_choice=choice)
    assert out["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": TOOL["input_schema"]}}]
    assert out["tool_choice"] == openai
    assert "parallel_tool_calls" not in out


def test_disable_parallel_tool_use_is_parallel_tool_calls_false() -> None:
    out = translate(tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert out["parallel_tool_calls"] is False


def test_a_tool_conversation_becomes_tool_calls_and_tool_messages() -> None:
    out = translate(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C"},
            {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ])
    assert out["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_02", "content": "Error: timeout"},
        {"role": "user", "content": "And tomorrow?"},
    ]


def test_an_assistant_turn_of_only_tool_calls_has_no_content() -> None:
    out = translate(messages=[USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}])
    assert out["messages"][1]["content"] is None
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "toolu_9", "content": ""}


@pytest.mark.parametrize("fields, param, code", [
    ({"top_k": 5}, "top_k", "unsupported_parameter"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "unsupported_parameter"),
    ({"service_tier": "priority"}, "service_tier", "unsupported_parameter"),
    ({"mcp_servers": []}, "mcp_servers", "unsupported_parameter"),
    ({"logit_bias": {}}, "logit_bias", "unknown_parameter"),
    ({"n": 1}, "n", "unknown_parameter"),
    ({"temperature": 1.5}, "temperature", "invalid_value"),
    ({"temperature": "0.5"}, "temperature", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": None}, "max_tokens", "invalid_value"),
    ({"stream": "true"}, "stream", "invalid_value"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences", "invalid_value"),
    ({"metadata": {"user_id": "u", "extra": 1}}, "metadata.extra", "invalid_value"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type",
     "unsupported_parameter"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name", "invalid_value"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages.0.content.0", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0", "unsupported_parameter"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "invalid_value"),
    ({"messages": [USER, {"role": "assistant", "content": "The answer is"}]}, "messages.1.role",
     "unsupported_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict[str, Any], param: str,
                                                    code: str) -> None:
    error = refusal(**fields)
    assert (error.param, error.code) == (param, code)


@pytest.mark.parametrize("fields", [
    {"thinking": {"type": "disabled"}}, {"service_tier": "auto"}, {"top_k": None},
    {"metadata": {"user_id": None}},
])
def test_values_that_ask_for_nothing_are_accepted(fields: dict[str, Any]) -> None:
    assert translate(**fields)["model"] == "m"


@pytest.mark.parametrize("version", [None, "2023-06-01", "2026-10-21"])
def test_the_version_header_is_optional_and_any_version_since_2023_06_01_is_served(
        version: str | None) -> None:
    anthropic_api.check_version(version)


@pytest.mark.parametrize("version", ["2023-01-01", "latest", "2023-6-1", ""])
def test_an_earlier_or_malformed_version_is_refused(version: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        anthropic_api.check_version(version)
    assert caught.value.param == "anthropic-version"


# -- non-streamed answers -----------------------------------------------------------------

def completion(message: dict[str, Any], finish: str, **choice: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}


@pytest.mark.parametrize("finish, stop_reason", [
    ("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"),
])
def test_a_text_answer_is_a_message(finish: str, stop_reason: str) -> None:
    message = message_of(completion({"role": "assistant", "content": "Hello."}, finish))
    assert message == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                       "content": [{"type": "text", "text": "Hello."}],
                       "stop_reason": stop_reason, "stop_sequence": None,
                       "usage": {"input_tokens": 11, "output_tokens": 7}}


def test_a_stop_sequence_is_named_when_the_worker_says_which() -> None:
    body = completion({"role": "assistant", "content": "a"}, "stop", stop_reason="END")
    message = message_of(body, ["END"])
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert message_of(body, ["OTHER"])["stop_reason"] == "end_turn"


def test_tool_calls_are_tool_use_blocks() -> None:
    body = completion({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "toolu_kept", "type": "function", "function": {"name": "f", "arguments": "{}"}},
    ]}, "tool_calls")
    message = message_of(body)
    assert message["content"] == [
        {"type": "tool_use", "id": "toolu_call_1", "name": "get_weather",
         "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_kept", "name": "f", "input": {}}]
    assert message["stop_reason"] == "tool_use"


def test_tool_arguments_that_are_no_json_object_are_an_upstream_fault() -> None:
    body = completion({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]},
        "tool_calls")
    with pytest.raises(UpstreamFailed):
        message_of(body)


# -- streamed answers ----------------------------------------------------------------------

def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    parsed = SseParser().feed(raw)
    return [(e.event or "", orjson.loads(e.data)) for e in parsed]


def run(stream: MessageStream, chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    raw = b"".join(stream.chunk(c) for c in chunks) + stream.done()
    return events(raw)


def test_a_text_stream_has_anthropics_events_in_order() -> None:
    out = run(MessageStream(), [chunk({"role": "assistant", "content": ""}),
                                chunk({"content": "Hel"}), chunk({"content": "lo"}),
                                chunk({}, "stop"), USAGE])
    assert [name for name, _ in out] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(payload["type"] == name for name, payload in out)
    start = out[0][1]["message"]
    assert (start["id"], start["role"], start["content"], start["stop_reason"]) == (
        "msg_abc", "assistant", [], None)
    assert out[1][1] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    assert out[3][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert out[6][1] == {"type": "message_delta",
                         "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                         "usage": {"input_tokens": 5, "output_tokens": 3}}


def test_streamed_tool_calls_are_tool_use_blocks_with_json_deltas() -> None:
    out = run(MessageStream(), [
        chunk({"role": "assistant", "content": "Checking."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "f", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"), USAGE])
    names = [name for name, _ in out]
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert out[5][1] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_call_1", "name": "get_weather", "input": {}}}
    partial = "".join(p["delta"]["partial_json"] for n, p in out
                      if n == "content_block_delta" and p["index"] == 1)
    assert orjson.loads(partial) == {"city": "Paris"}
    assert out[9][1]["index"] == 2 and out[9][1]["content_block"]["id"] == "toolu_call_2"
    assert out[12][1]["delta"]["stop_reason"] == "tool_use"


def test_a_stream_that_fails_midway_ends_with_an_error_event() -> None:
    stream = MessageStream()
    raw = stream.chunk(chunk({"content": "Hel"})) + stream.chunk(
        {"error": {"message": "the model server failed", "type": "upstream_error",
                   "code": "upstream_failed"}})
    raw += stream.chunk(chunk({"content": "ignored"})) + stream.done()
    out = events(raw)
    assert out[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "the model server failed"}})
    assert [n for n, _ in out].count("error") == 1 and "message_stop" not in [n for n, _ in out]


def test_a_keep_alive_is_a_ping() -> None:
    assert events(MessageStream().heartbeat()) == [("ping", {"type": "ping"})]
    assert anthropic_reply.PING.startswith(b"event: ping\ndata: ")


# -- errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("error, status, kind", [
    (InvalidRequest("bad"), 400, "invalid_request_error"),
    (AuthenticationFailed("invalid API key"), 401, "authentication_error"),
    (ModelNotFound("no"), 404, "not_found_error"),
    (RateLimited("slow down", retry_after=2), 429, "rate_limit_error"),
    (NoHealthyWorker("none", retry_after=1), 529, "overloaded_error"),
    (GatewayDraining("bye", retry_after=1), 529, "overloaded_error"),
    (UpstreamFailed("detail"), 502, "api_error"),
])
def test_errors_have_anthropics_shape_and_status(error: Any, status: int, kind: str) -> None:
    shaped = AnthropicShaped(error, "req-1")
    assert shaped.status == status
    assert shaped.envelope() == {"type": "error", "error": {"type": kind, "message": error.message},
                                 "request_id": "req-1"}
    assert shaped.headers() == error.headers()  # Retry-After kept
