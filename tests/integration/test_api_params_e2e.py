"""The official OpenAI SDK against a live gateway (simulated worker): what Hedgerow
cannot honour is a 400 naming the field, never a 200 with a wrong answer."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("apiparams"))
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", "--backend", "sim", "--slots", "4",
                           "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "1")
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> Iterator[openai.OpenAI]:
    verify = ssl.create_default_context(cafile=stack.ca_cert)
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="sk-demo", max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=verify)) as client:
        yield client


def refused(call: Any, **fields: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call(**fields)
    assert caught.value.status_code == 400
    return caught.value


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fields, param", [
    ({"functions": [TOOLS[0]["function"]]}, "functions"),
    ({"store": True}, "store"),
    ({"messages": [*HI, {"role": "function", "name": "get_weather", "content": "12 C"}]},
     "messages.1.role"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/owl.png"}}]}]},
     "messages.0.content.0"),
])
def test_the_sdk_gets_a_bad_request_naming_what_hedgerow_cannot_do(
        sdk: openai.OpenAI, fields: dict[str, Any], param: str, stream: bool) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 8, "stream": stream, **fields}
    error = refused(sdk.chat.completions.create, **body)
    assert (error.code, error.param) == ("unsupported_parameter", param)


def test_fields_openai_does_not_define_are_unrecognized(sdk: openai.OpenAI) -> None:
    error = refused(sdk.chat.completions.create, model=MODEL, messages=HI, max_tokens=8,
                    extra_body={"top_k": 40})
    assert (error.code, error.param) == ("unknown_parameter", "top_k")
    assert "Unrecognized request argument supplied: top_k" in error.message
    error = refused(sdk.completions.create, model=MODEL, prompt="Once", max_tokens=8,
                    echo=True)
    assert (error.code, error.param) == ("unsupported_parameter", "echo")


def test_no_op_values_and_harmless_fields_are_served(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief.", "name": "ops"}, *HI],
        max_tokens=8, n=1, logprobs=False, response_format={"type": "text"},
        tool_choice="none", parallel_tool_calls=False, store=False, user="u-1",
        metadata={"trace": "t-1"}, safety_identifier="h-1", service_tier="auto",
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"42": -100},
        stream_options=None)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    text = sdk.completions.create(model=MODEL, prompt="Once", max_tokens=4, n=1, best_of=1,
                                  echo=False, presence_penalty=1.0, logit_bias={"7": 3})
    assert text.choices[0].text


def test_a_penalty_is_part_of_the_exact_cache_key(sdk: openai.OpenAI) -> None:
    def cache_of(**fields: Any) -> str:
        raw = sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=6, temperature=0, **fields)
        return raw.headers["x-hedgerow-cache"]

    assert cache_of() == "miss"
    assert cache_of() == "exact"
    assert cache_of(presence_penalty=1.0) == "miss"  # a different answer: not the cached one
    assert cache_of(presence_penalty=1.0) == "exact"
    assert cache_of(logit_bias={"42": -100}) == "miss"
    assert cache_of(presence_penalty=0, logit_bias={}) == "exact"  # asks for nothing new
