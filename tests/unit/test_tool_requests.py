"""Tools, tool_choice, response_format and logprobs: parsed strictly, carried whole,
scanned into OpenAI's stream shape, and folded back into the whole answer."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from gateway.corridor.attempt import carries_output
from gateway.corridor.relay import RelayOutcome, completion_body, observe_chunk
from hedgerow import openai_api as oa
from hedgerow.completion_fold import CompletionFold, replay_deltas, replayable
from hedgerow.errors import InvalidRequest
from workers.tool_calls import (
    CallArguments,
    CallStart,
    TextOut,
    ToolCallScanner,
    ToolSpec,
    call_prefill,
    grammar_for,
    known_call,
    render_messages,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def chat(**fields: Any) -> oa.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return oa.parse_request(orjson.dumps(body), oa.ChatCompletionRequest)


def test_tool_choice_decides_the_mode() -> None:
    assert chat().tool_mode() is None
    assert chat(tools=[WEATHER]).tool_mode() == "auto"
    assert chat(tools=[WEATHER], tool_choice="none").tool_mode() is None
    assert chat(tools=[WEATHER], tool_choice="required").tool_mode() == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=[WEATHER], tool_choice=named).tool_mode() == "function:get_weather"


@pytest.mark.parametrize("fields", [
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
    {"tool_choice": "required"},
    {"tools": [WEATHER, WEATHER]},
    {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "colour": "red"}}]},
    {"logprobs": False, "top_logprobs": 2},
    {"logprobs": True, "top_logprobs": 21},
    {"response_format": {"type": "json_schema"}},
    {"messages": [{"role": "tool", "content": "12 C"}]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
])
def test_inconsistent_tool_requests_are_invalid_values(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        chat(**fields)
    assert caught.value.code == "invalid_value"


def test_a_tool_conversation_reaches_the_model_whole() -> None:
    parsed = chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}])
    shaped = [m.for_model() for m in parsed.messages]
    assert shaped[1]["tool_calls"] == [CALL] and shaped[2]["tool_call_id"] == "call_1"
    schema = json.dumps(WEATHER["function"]["parameters"])
    tools = (ToolSpec("get_weather", "Weather in a city", schema),)
    rendered = render_messages(tuple(shaped), tools, "auto")
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert '"arguments": {"city": "Oslo"}' in rendered[2]["content"]
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}


def scan(mode: str | None, pieces: list[str], complete: bool = True) -> list[Any]:
    known = mode.removeprefix("function:") if mode and mode.startswith("function:") else None
    scanner = ToolCallScanner(mode, known)
    outs: list[Any] = []
    for piece in pieces:
        outs += scanner.feed(piece)
    return outs + scanner.finish(complete)


def test_a_forced_call_streams_its_name_first_then_argument_fragments() -> None:
    outs = scan("required", ['{"name": "get', '_weather", "arguments": {"ci', 'ty": "Oslo"',
                             '}', ' }'])
    assert isinstance(outs[0], CallStart) and outs[0].name == "get_weather"
    assert outs[0].id.startswith("call_")
    arguments = "".join(o.fragment for o in outs[1:] if isinstance(o, CallArguments))
    assert json.loads(arguments) == {"city": "Oslo"} and arguments.endswith("}")


def test_auto_mode_passes_text_through_and_opens_a_call_on_its_marker() -> None:
    assert scan("auto", ["Hello", " there"]) == [TextOut("Hello"), TextOut(" there")]
    outs = scan("auto", ["<tool", "_call>\n", '{"name": "get_weather", "arguments": {}}'])
    assert isinstance(outs[0], CallStart) and outs[0].name == "get_weather"
    assert "".join(o.fragment for o in outs[1:]) == "{}"


def test_a_call_cut_by_max_tokens_keeps_what_was_written() -> None:
    outs = scan("required", ['{"name": "get_weather", "arguments": {"city": {', '}'],
                complete=False)
    assert "".join(o.fragment for o in outs[1:]) == '{"city": {}'


def test_grammars_are_built_from_the_schemas() -> None:
    tools = (ToolSpec("get_weather", "", json.dumps(WEATHER["function"]["parameters"])),
             ToolSpec("noop", "", "{}"))
    forced = grammar_for(tools, "function:get_weather", None)  # its arguments alone
    assert forced is not None and "city" in forced and "noop" not in forced
    either = grammar_for(tools, "required", None)
    assert either is not None and "get_weather" in either and "noop" in either
    auto = grammar_for(tools, "auto", None)
    assert auto is not None and auto.startswith('root ::= "<tool_call>\\n" call |')
    assert grammar_for((), None, None) is None
    assert "root ::=" in (grammar_for((), None, '{"type": "object"}') or "")
    with pytest.raises(InvalidRequest):
        grammar_for((), None, "{not json")


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0,
          logprobs: Any = None) -> dict[str, Any]:
    return oa.chat_chunk("r", "m", 1, delta, finish, logprobs, index)


def test_the_fold_rebuilds_tool_calls_logprobs_and_choices_as_an_sdk_does() -> None:
    fold = CompletionFold()
    for c in [chunk({"role": "assistant", "content": ""}),
              chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}),
              chunk({"content": "Hi"}, index=1,
                    logprobs={"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                                           "top_logprobs": []}]}),
              chunk({}, "tool_calls"), chunk({}, "stop", index=1)]:
        fold.feed(c)
    first, second = fold.chat_choices()
    assert first["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert first["finish_reason"] == "tool_calls"
    assert second["message"]["content"] == "Hi"
    assert second["logprobs"]["content"][0]["token"] == "Hi"


def test_replayed_deltas_fold_back_into_the_same_choice() -> None:
    entries = [{"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []}
               for t in ("Hel", "lo")]
    for content, calls, logprobs in [("Hello", [], entries), (None, [CALL], None),
                                     ("Some words here and more", [], None)]:
        fold = CompletionFold()
        for delta, shown in replay_deltas(content, calls, logprobs):
            fold.feed(chunk(delta, None, 0, shown))
        choice = fold.first()
        assert replayable(choice)
        assert choice.message() == {"role": "assistant", "content": content,
                                    **({"tool_calls": calls} if calls else {})}
        assert choice.logprobs == logprobs


def test_a_known_function_streams_its_arguments_alone() -> None:
    outs = scan("function:get_weather", ['{"city"', ': "Oslo"}', " "])
    scanner_start = outs[0]
    assert isinstance(scanner_start, CallStart) and scanner_start.name == "get_weather"
    assert "".join(o.fragment for o in outs[1:]) == '{"city": "Oslo"}'


def test_a_forced_call_to_one_function_names_it_in_the_prompt() -> None:
    tools = (ToolSpec("get_weather", "", json.dumps(WEATHER["function"]["parameters"])),)
    assert call_prefill(tools, "required").endswith('{"name": "get_weather", "arguments": ')
    assert call_prefill(tools, "auto") == "" and call_prefill(tools, None) == ""
    both = (*tools, ToolSpec("noop", "", "{}"))
    assert call_prefill(both, "required") == "<tool_call>\n"
    assert known_call(both, "function:noop") == both[1]


@pytest.mark.parametrize("delta, output", [
    ({"role": "assistant", "content": ""}, False),
    ({"content": "Hi"}, True),
    ({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                      "function": {"name": "f", "arguments": ""}}]}, True),
    ({"reasoning_content": "Let me think"}, True),
])
def test_a_streamed_tool_call_or_reasoning_is_a_first_token(delta: dict[str, Any],
                                                            output: bool) -> None:
    assert carries_output(chunk(delta)) is output


def test_a_non_streaming_client_of_the_gateway_gets_the_tool_call_whole() -> None:
    outcome = RelayOutcome(keep_text=True)
    for c in [chunk({"role": "assistant", "content": ""}),
              chunk({"tool_calls": [{"index": 0, "id": "call_2", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
              chunk({}, "tool_calls")]:
        observe_chunk(outcome, c)
    assert outcome.pieces == 2  # both deltas are tokens to the relay's metrics
    body = orjson.loads(completion_body("r", "m", outcome, chat=True))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_starts_as_soon_as_its_name_is_written() -> None:
    scanner = ToolCallScanner("required")
    assert scanner.feed('{"name": "get_') == []
    started = scanner.feed('weather", ')
    assert [type(o) for o in started] == [CallStart] and started[0].name == "get_weather"
    assert scanner.feed('"arguments": {"city": "Oslo"}}') == [CallArguments('{"city": "Oslo"')]
    assert scanner.finish(complete=True) == [CallArguments("}")]


def test_fields_the_fold_does_not_know_reach_the_message_but_are_never_cached() -> None:
    fold = CompletionFold()
    fold.feed(chunk({"reasoning_content": "Think. "}))
    fold.feed(chunk({"content": "Hi"}))
    fold.feed({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": None}]})
    choice = fold.first()
    assert choice.message() == {"role": "assistant", "content": "Hi",
                                "reasoning_content": "Think. "}
    assert not replayable(choice)
    plain = CompletionFold()
    plain.feed({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop", "stop_reason": None}]})
    assert replayable(plain.first())  # a null field says nothing
    odd = CompletionFold()
    odd.feed({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop", "stop_reason": 7}]})
    assert not replayable(odd.first())
