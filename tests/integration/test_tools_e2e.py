"""The official OpenAI SDK against a live gateway and the real bundled model
(SmolLM2-135M-Instruct on llama.cpp): tool calls, structured output and
logprobs arrive in OpenAI's shape, streamed and whole, and a cached tool-call
answer comes back intact; the same through an external upstream (another real
worker) and, for a forced call, through Anthropic's Messages API."""

from __future__ import annotations

import hashlib
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.support.stack import Stack, free_port, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
UPSTREAM_MODEL = "smol-upstream"  # the same model, through an external upstream
KEY = "sk-tools-5e0c2a"
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20}},
                                          "required": ["city"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _policy(path: Path, upstream_port: int) -> Path:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    path.write_text(f"""
hedging: {{enabled: false}}
# A loaded 2-core machine, and a grammar costs time on every token.
timeouts: {{ttft_ms: 120000, idle_ms: 120000}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 20000, deadline_ms: 60000}}
tenants:
  - name: local
    class: interactive
  - name: agents
    class: interactive
    api_key_sha256: ["{digest}"]
models:
  - name: {MODEL}
cache:
  semantic: {{enabled: false}}
upstreams:  # a real llama.cpp worker outside the cluster, as a llama-server would be
  - name: llama-upstream
    url: http://127.0.0.1:{upstream_port}
    models: [{UPSTREAM_MODEL}]
    model_map: {{{UPSTREAM_MODEL}: {MODEL}}}
    probe_interval_ms: 500
""")
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("tools")
    stack = Stack(root)
    upstream_port = free_port()
    try:
        nowhere = f"http://127.0.0.1:{free_port()}"  # it never registers: the policy names it
        stack.spawn("llama-server", "worker", "--port", str(upstream_port), "--worker-id",
                    "llama-server", "--control-plane", nowhere, "--insecure-internal",
                    "--slots", "1")
        stack.start_control_plane(policy=_policy(root / "policy.yaml", upstream_port))
        stack.start_worker("w-tools", "--slots", "1")
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> Iterator[openai.OpenAI]:
    verify = ssl.create_default_context(cafile=stack.ca_cert)
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=KEY, max_retries=0,
                       timeout=120, http_client=openai.DefaultHttpxClient(verify=verify)) as client:
        yield client


def _valid_call(call: Any) -> dict[str, Any]:
    assert call.id.startswith("call_") and call.type == "function"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_a_named_function_is_called_with_arguments_valid_for_its_schema(
        sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice=NAMED, max_tokens=48, temperature=0.7)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    _valid_call(call)


def test_a_required_call_streams_as_openai_deltas(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="required", max_tokens=48, stream=True,
                                         temperature=0.7)
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.arguments) == (0, "function", "")
    assert first.id.startswith("call_") and first.function.name in SCHEMAS
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert finish == "tool_calls"
    arguments = json.loads("".join(d.function.arguments for d in rest))
    jsonschema.validate(arguments, SCHEMAS[first.function.name])


def test_auto_answers_in_text_or_with_a_valid_call(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="auto", max_tokens=16, temperature=0)
    choice = answer.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _valid_call(choice.message.tool_calls[0])
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_json_schema_output_validates_against_its_schema(sdk: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}
    answer = sdk.chat.completions.create(
        model=MODEL, max_tokens=64, temperature=0.7,
        messages=[{"role": "user", "content": "Invent a person with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": schema, "strict": True}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_output_is_an_object(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}])
    content = answer.choices[0].message.content or ""
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    assert content.lstrip().startswith("{")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_come_with_each_token(sdk: openai.OpenAI, stream: bool) -> None:
    fields: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                  max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    if stream:  # live from the worker, not the whole answer's replay from the cache
        entries, text = [], ""
        for chunk in sdk.chat.completions.create(stream=True, **fields,
                                                 extra_headers={"cache-control": "no-cache"}):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                entries += (choice.logprobs.content or []) if choice.logprobs else []
    else:
        choice = sdk.chat.completions.create(**fields).choices[0]
        assert choice.logprobs is not None and choice.logprobs.content
        entries, text = choice.logprobs.content, choice.message.content or ""
    assert 1 <= len(entries) <= 6 and "".join(e.token for e in entries) == text
    for entry in entries:
        assert entry.logprob <= 0 and bytes(entry.bytes or []).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.top_logprobs[0].logprob >= entry.logprob


def test_a_cached_tool_call_is_replayed_intact_and_answered_after_its_result(
        sdk: openai.OpenAI) -> None:
    asked = [{"role": "user", "content": "Weather in Bergen, please."}]
    fields: dict[str, Any] = dict(model=MODEL, messages=asked, tools=TOOLS,
                                  tool_choice="required", max_tokens=48, temperature=0)
    live = sdk.chat.completions.with_raw_response.create(**fields)
    assert live.headers["x-hedgerow-cache"] == "miss"
    again = sdk.chat.completions.with_raw_response.create(**fields)
    assert again.headers["x-hedgerow-cache"] == "exact"
    first, second = live.parse().choices[0], again.parse().choices[0]
    assert second.model_dump() == first.model_dump()
    assert second.finish_reason == "tool_calls" and second.message.content is None
    streamed = sdk.chat.completions.create(stream=True, **fields)
    calls: dict[str, str] = {}
    finish = None
    for chunk in streamed:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id:
                    calls["id"], calls["name"] = delta.id, delta.function.name
                calls["arguments"] = calls.get("arguments", "") + (delta.function.arguments or "")
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls == {
        "id": first.message.tool_calls[0].id, "name": first.message.tool_calls[0].function.name,
        "arguments": first.message.tool_calls[0].function.arguments}

    # The conversation goes on: the assistant's call, the tool's result, then an answer.
    followup = [*asked, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.message.tool_calls[0].id,
                 "content": '{"temperature": 12, "unit": "celsius"}'}]
    answer = sdk.chat.completions.create(model=MODEL, messages=followup, tools=TOOLS,
                                         tool_choice="none", max_tokens=12, temperature=0)
    choice = answer.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_n_choices_come_whole_and_streamed_with_their_index(sdk: openai.OpenAI) -> None:
    fields: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                  max_tokens=5, temperature=1.0, seed=11, n=2)
    whole = sdk.chat.completions.create(**fields)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in whole.choices)
    assert whole.usage is not None and 2 <= whole.usage.completion_tokens <= 10
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in sdk.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1} and all(texts.values())
    # The same seeds: the streamed choices are the whole answer's, choice by choice.
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_an_external_upstream_relays_a_tool_call_field_for_field(
        stack: Stack, sdk: openai.OpenAI) -> None:
    wait_for(lambda: stack.worker("llama-upstream"), "the upstream's probe to pass")
    fields: dict[str, Any] = dict(model=UPSTREAM_MODEL, messages=ASK, tools=TOOLS,
                                  tool_choice=NAMED, max_tokens=48, temperature=0.7)
    raw = sdk.chat.completions.with_raw_response.create(**fields)
    assert raw.headers["x-hedgerow-worker"] == "llama-upstream"
    answer = raw.parse()
    assert answer.model == UPSTREAM_MODEL  # the upstream's own name mapped back
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    _valid_call(choice.message.tool_calls[0])


def test_anthropic_clients_get_a_forced_call_as_a_tool_use_block(stack: Stack) -> None:
    verify = ssl.create_default_context(cafile=stack.ca_cert)
    with anthropic.Anthropic(base_url=stack.gateway_url, api_key=KEY, max_retries=0, timeout=120,
                             http_client=anthropic.DefaultHttpxClient(verify=verify)) as claude:
        message = claude.messages.create(
            model=MODEL, max_tokens=48, messages=[{"role": "user", "content": ASK[0]["content"]}],
            tools=[{"name": "get_weather", "description": "Weather in a city",
                    "input_schema": WEATHER_SCHEMA}],
            tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
