"""Every OpenAI request field is implemented, carried, accepted or refused by name: never dropped."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types import completion_create_params as sdk_completion
from openai.types.chat import completion_create_params as sdk_chat

from hedgerow import api_params
from hedgerow import openai_api as oa
from hedgerow.errors import InvalidRequest

README = Path(__file__).resolve().parents[2] / "README.md"
USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> oa.ChatCompletionRequest:
    body = {"model": "m", "messages": [USER], **fields}
    return oa.parse_request(orjson.dumps(body), oa.ChatCompletionRequest)


def completion(**fields: Any) -> oa.CompletionRequest:
    body = {"model": "m", "prompt": "Once", **fields}
    return oa.parse_request(orjson.dumps(body), oa.CompletionRequest)


def refusal(parse: Any, **fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    assert caught.value.status == 400
    assert caught.value.envelope()["error"]["type"] == "invalid_request_error"
    return caught.value


def sdk_fields(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.mark.parametrize("module, table", [(sdk_chat, api_params.CHAT_PARAMS),
                                           (sdk_completion, api_params.COMPLETION_PARAMS)],
                         ids=["chat", "completions"])
def test_every_field_the_official_sdk_sends_is_classified(module: Any, table: dict[str, Any]) -> None:
    assert sdk_fields(module) == set(table)


def test_the_readme_table_lists_every_field_with_what_the_code_does() -> None:
    text = README.read_text()
    section = text[text.index("### Request parameters"):]
    section = section[:section.index("\n#", 1)]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_.]+)`", cells[0]):
                rows[name] = cells[1]
    for table in (api_params.CHAT_PARAMS, api_params.COMPLETION_PARAMS):
        for name, param in table.items():
            assert name in rows, f"README has no row for {name}"
            assert param.support in rows[name], (name, rows[name], param.support)


REFUSED_CHAT = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "mp3"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("web_search_options", {}),
    ("moderation", {"model": "omni"}),
    ("service_tier", "flex"),
    ("store", True),
    ("prompt_cache_retention", "24h"),
    ("prompt_cache_options", {"ttl": "30m"}),
]


@pytest.mark.parametrize("field, value", REFUSED_CHAT)
def test_chat_fields_hedgerow_cannot_honour_are_refused_by_name(field: str, value: Any) -> None:
    error = refusal(chat, **{field: value})
    assert (error.code, error.param) == ("unsupported_parameter", field)
    assert field in error.message


@pytest.mark.parametrize("field, value", [
    ("best_of", 2), ("echo", True), ("suffix", "end"), ("logprobs", 0), ("logprobs", 5),
    ("prompt", ["a", "b"]), ("prompt", [1, 2, 3]),
])
def test_completion_fields_hedgerow_cannot_honour_are_refused_by_name(field: str, value: Any) -> None:
    error = refusal(completion, **{field: value})
    assert (error.code, error.param) == ("unsupported_parameter", field)


@pytest.mark.parametrize("fields", [
    {"n": 1}, {"logprobs": False}, {"response_format": {"type": "text"}},
    {"tool_choice": "none"}, {"function_call": "none"}, {"parallel_tool_calls": True},
    {"modalities": ["text"]}, {"service_tier": "auto"}, {"service_tier": "default"},
    {"store": False}, {"user": "u-17"}, {"metadata": {"trace": "abc"}},
    {"safety_identifier": "h-1"}, {"prompt_cache_key": "k"},
    {"stream_options": {"include_usage": True, "include_obfuscation": False}},
    # null is the same as leaving a field out, for every optional field
    {"tools": None, "logprobs": None, "temperature": None, "n": None, "stop": None, "audio": None},
])
def test_chat_no_op_values_are_accepted(fields: dict[str, Any]) -> None:
    assert chat(**fields).model == "m"


def test_null_means_the_default() -> None:
    parsed = chat(temperature=None, top_p=None, max_tokens=None, presence_penalty=None)
    assert (parsed.temperature, parsed.top_p, parsed.token_limit(), parsed.presence_penalty) == (
        1.0, 1.0, None, 0.0)
    assert refusal(chat, model=None).param == "model"
    assert refusal(chat, stream=None).param == "stream"  # no boolean: never a silent false


@pytest.mark.parametrize("fields", [
    {"n": 1}, {"best_of": 1}, {"echo": False}, {"suffix": ""}, {"logprobs": None}, {"user": "u"},
])
def test_completion_no_op_values_are_accepted(fields: dict[str, Any]) -> None:
    assert completion(**fields).prompt == "Once"


@pytest.mark.parametrize("parse, field", [
    (chat, "top_k"), (chat, "min_p"), (chat, "repeat_penalty"), (chat, "grammar"), (chat, "foo"),
    # OpenAI's, but of the other endpoint
    (completion, "max_completion_tokens"), (completion, "messages"), (completion, "tools"),
    (completion, "store"), (chat, "prompt"), (chat, "best_of"), (chat, "echo"),
])
def test_fields_openai_does_not_define_are_refused_as_unknown(parse: Any, field: str) -> None:
    error = refusal(parse, **{field: 1})
    assert (error.code, error.param) == ("unknown_parameter", field)
    assert error.message == f"Unrecognized request argument supplied: {field}"


def test_unknown_stream_option_is_named() -> None:
    error = refusal(chat, stream=True, stream_options={"include_usage": True, "chunk_ms": 5})
    assert (error.code, error.param) == ("unknown_parameter", "stream_options.chunk_ms")
    error = refusal(chat, stream=True, stream_options={"include_obfuscation": True})
    assert (error.code, error.param) == ("unsupported_parameter", "stream_options.include_obfuscation")


def test_carried_sampling_fields_are_parsed_for_the_worker() -> None:
    parsed = chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"42": -100, "7": 5})
    assert parsed.presence_penalty == 0.5 and parsed.frequency_penalty == -1.0
    assert parsed.token_biases() == ((42, -100), (7, 5))
    text = completion(presence_penalty=2, logit_bias={"3": 100})
    assert text.presence_penalty == 2.0 and text.token_biases() == ((3, 100),)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", "0.5"), ("frequency_penalty", -3),
    ("frequency_penalty", True),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"-5": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"5": 1.5}), ("logit_bias", {"5": "1"}), ("logit_bias", [5]),
    ("logit_bias", {str(i): 1 for i in range(oa.MAX_LOGIT_BIAS + 1)}),
    ("n", 0), ("n", True), ("n", 1.0),
    ("user", 5), ("metadata", {"k": {"nested": 1}}), ("metadata", {str(i): "v" for i in range(17)}),
    ("parallel_tool_calls", "true"), ("safety_identifier", "x" * 129),
    ("stream", "true"), ("stream", 1), ("max_tokens", "5"), ("stop", 5), ("stop", ["a", 1]),
])
def test_types_and_ranges_are_strict(field: str, value: Any) -> None:
    error = refusal(chat, **{field: value})
    assert (error.code, error.param.split(".")[0] if error.param else None) == ("invalid_value", field)


# -- messages ---------------------------------------------------------------------------

def test_messages_keep_name_and_text_parts() -> None:
    parsed = chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}], "name": "ops"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None,
         "function_call": None, "audio": None},
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])
    assert [m.for_model() for m in parsed.messages] == [
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello"},
        {"role": "developer", "content": "a\nb"},
    ]


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("message, param", [
    ({"role": "function", "content": "42", "name": "f"}, "messages.1.role"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
     "messages.1.function_call"),
    ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "messages.1.audio"),
    ({"role": "assistant", "content": None, "refusal": "no"}, "messages.1.refusal"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
     "messages.1.content.0"),
    ({"role": "user", "content": [{"type": "text", "text": "a"},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]},
     "messages.1.content.1"),
    ({"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}, "messages.1.content.0"),
    ({"role": "user", "content": [{"type": "text", "text": "a",
                                   "prompt_cache_breakpoint": {"mode": "explicit"}}]},
     "messages.1.content.0.prompt_cache_breakpoint"),
])
def test_function_turns_and_non_text_content_are_refused_by_path(message: dict[str, Any], param: str) -> None:
    error = refusal(chat, messages=[USER, message])
    assert (error.code, error.param) == ("unsupported_parameter", param)


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "x", "tool_calls": [TOOL_CALL]}, "messages.0.tool_calls"),
    ({"role": "user", "content": "x", "tool_call_id": "call_1"}, "messages.0.tool_call_id"),
    ({"role": "user", "content": "x", "weight": 2}, "messages.0.weight"),
])
def test_message_fields_openai_does_not_define_for_the_role_are_unknown(
        message: dict[str, Any], param: str) -> None:
    error = refusal(chat, messages=[message])
    assert (error.code, error.param) == ("unknown_parameter", param)


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": 5}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages.0.content"),
    ({"role": "user", "content": "x", "name": 7}, "messages.0.name"),
])
def test_message_types_are_strict(message: dict[str, Any], param: str) -> None:
    error = refusal(chat, messages=[message])
    assert error.code == "invalid_value" and error.param is not None
    assert error.param.startswith(param)


def test_a_refused_field_name_is_cut_short_in_the_error() -> None:
    error = refusal(chat, **{"x" * 10_000: 1})
    assert error.param == "x" * api_params.MAX_NAME_SHOWN and len(error.message) < 200
