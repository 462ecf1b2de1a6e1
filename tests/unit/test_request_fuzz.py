"""Hostile request bodies: the parser answers 400 or a valid request, nothing else."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from hedgerow import openai_api as oa
from hedgerow.errors import InvalidRequest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)

chat_like = st.fixed_dictionaries(
    {"model": st.one_of(st.text(max_size=300), json_values),
     "messages": st.one_of(
         st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", ""]),
                                         "content": st.one_of(st.text(max_size=50), json_values)}),
                  max_size=3),
         json_values)},
    optional={"stream": json_values, "max_tokens": st.one_of(st.integers(-(2**63), 2**63 - 1), json_values),
              "temperature": st.one_of(st.floats(allow_nan=True), json_values),
              "stop": json_values, "n": json_values, "stream_options": json_values},
)


def _parse_or_400(body: bytes) -> None:
    for shape in (oa.ChatCompletionRequest, oa.CompletionRequest):
        try:
            parsed = oa.parse_request(body, shape)
        except InvalidRequest as error:
            assert error.status == 400 and error.envelope()["error"]["message"]
        else:
            assert parsed.model


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes(body: bytes) -> None:
    _parse_or_400(body)


@settings(max_examples=300)
@given(json_values)
def test_arbitrary_json(value: object) -> None:
    _parse_or_400(orjson.dumps(value))


@settings(max_examples=300)
@given(chat_like)
def test_chat_shaped_json(value: dict[str, object]) -> None:
    _parse_or_400(orjson.dumps(value))


def test_deeply_nested_json_is_a_400_not_a_crash() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    _parse_or_400(deep)
    nested = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    _parse_or_400(nested)


def test_huge_numbers_are_a_400() -> None:
    for raw in (b"123456789012345678901234567890", b"1e400", b"-1e400"):
        body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": ' + raw + b"}"
        _parse_or_400(body)
