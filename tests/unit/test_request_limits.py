"""Hostile sizes: every limit in the policy's ``limits`` (and a class's
``max_tokens``) refuses with a 400 and the OpenAI envelope naming the
parameter, and a request within every limit passes."""

from __future__ import annotations

import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hedgerow import openai_api as oa
from hedgerow.errors import InvalidRequest
from policies.request_limits import check_request_limits, token_cap
from policies.schema import PolicyError, parse_policy

POLICY = parse_policy("""
limits: {max_messages: 4, max_message_chars: 100, max_prompt_chars: 250, max_tokens: 1000}
classes:
  - {name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000, max_tokens: 200}
  - {name: batch, ttft_slo_ms: 30000, deadline_ms: 120000}
tenants:
  - {name: local, class: interactive}
  - {name: bulk, class: batch}
anonymous_tenant: local
""")


def _refusal(klass: str, chars: tuple[int, ...], tokens: int | None,
             chat: bool = True) -> dict[str, object] | None:
    try:
        check_request_limits(POLICY, klass, message_chars=chars, token_limit=tokens, chat=chat)
    except InvalidRequest as error:
        assert error.status == 400
        envelope = error.envelope()["error"]
        assert envelope["type"] == "invalid_request_error" and envelope["message"]
        return dict(envelope)
    return None


def test_a_request_within_every_limit_passes() -> None:
    assert _refusal("interactive", (100, 100, 50), 200) is None
    assert _refusal("batch", (10,), 1000) is None
    assert _refusal("batch", (10,), None) is None


@pytest.mark.parametrize("klass, chars, tokens, param, code", [
    ("interactive", (1,) * 5, None, "messages", "too_many_messages"),
    ("interactive", (10, 101), None, "messages.1.content", "message_too_long"),
    ("interactive", (100, 100, 51), None, "messages", "prompt_too_long"),
    ("interactive", (1,), 201, "max_tokens", "max_tokens_too_large"),
    ("batch", (1,), 1001, "max_tokens", "max_tokens_too_large"),
])
def test_each_limit_refuses_naming_the_parameter(
        klass: str, chars: tuple[int, ...], tokens: int | None, param: str, code: str) -> None:
    refusal = _refusal(klass, chars, tokens)
    assert refusal is not None and refusal["param"] == param and refusal["code"] == code


def test_a_text_completion_prompt_is_bounded_as_one_message() -> None:
    refusal = _refusal("batch", (101,), None, chat=False)
    assert refusal is not None and refusal["param"] == "prompt"


def test_a_class_cap_never_raises_the_global_one() -> None:
    loose = parse_policy("""
limits: {max_tokens: 100}
classes: [{name: c, ttft_slo_ms: 1, deadline_ms: 1, max_tokens: 5000}]
""")
    assert token_cap(loose, "c") == 100
    assert token_cap(POLICY, "interactive") == 200 and token_cap(POLICY, "batch") == 1000


@settings(max_examples=200)
@given(st.lists(st.integers(0, 400), max_size=8), st.one_of(st.none(), st.integers(1, 5000)),
       st.sampled_from(["interactive", "batch"]))
def test_refused_exactly_when_some_limit_is_exceeded(
        chars: list[int], tokens: int | None, klass: str) -> None:
    cap = 200 if klass == "interactive" else 1000
    over = (len(chars) > 4 or any(c > 100 for c in chars) or sum(chars) > 250
            or (tokens is not None and tokens > cap))
    assert (_refusal(klass, tuple(chars), tokens) is not None) == over


def _body(content: object, **extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                         **extra})


def test_json_nested_past_the_depth_limit_is_a_400() -> None:
    shallow: object = "x"
    for _ in range(oa.MAX_JSON_DEPTH - 1):  # the body object is one more level
        shallow = [shallow]
    oa.decode_request(_body("hi", extra=shallow))  # deep enough, not too deep
    deep: object = [shallow]
    with pytest.raises(InvalidRequest) as refused:
        oa.parse_request(_body("hi", extra=deep), oa.ChatCompletionRequest)
    assert refused.value.status == 400 and refused.value.code == "json_too_deep"


def test_message_chars_count_text_parts_and_prompts() -> None:
    parts = [{"type": "text", "text": "abc"}, {"type": "text", "text": "de"}]
    chat = oa.parse_request(
        orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "xy"},
                                                 {"role": "user", "content": parts}]}),
        oa.ChatCompletionRequest)
    assert chat.message_chars() == (2, 6)  # the parts, a line each
    text = oa.parse_request(b'{"model": "m", "prompt": "hello"}', oa.CompletionRequest)
    assert text.message_chars() == (5,)


LIMIT_FIELDS = ("max_messages", "max_message_chars", "max_prompt_chars", "max_tokens")
limit_values = st.one_of(st.integers(-5, 10_000), st.floats(allow_nan=True), st.text(max_size=5),
                         st.none(), st.booleans())


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(LIMIT_FIELDS), limit_values, max_size=4), limit_values)
def test_limits_in_a_policy_are_accepted_or_refused_with_the_field_named(
        limits: dict[str, object], class_cap: object) -> None:
    document = {"limits": limits,
                "classes": [{"name": "c", "ttft_slo_ms": 1, "deadline_ms": 1,
                             "max_tokens": class_cap}]}
    try:
        policy = parse_policy(yaml.safe_dump(document), "fuzz.yaml")
    except PolicyError as error:
        assert all(issue.path.startswith(("limits.", "classes[0].max_tokens"))
                   for issue in error.issues), error
        return
    for name, value in limits.items():  # accepted: the number given (pydantic's lax "1" -> 1)
        assert isinstance(value, (int, float, str)) and getattr(policy.limits, name) == float(value)
    assert token_cap(policy, "c") >= 1
