"""Exact cache keys: what must, and must not, change the key; who may cache."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.cache.keys import bypasses_lookup, cache_keys, cacheable, forbids_store
from policies.loader import parse_policy_document
from policies.schema import Policy

POLICY = parse_policy_document("""
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants:
  - {name: a, class: interactive}
  - {name: b, class: interactive}
  - {name: c, class: interactive}
  - {name: d, class: interactive}
models:
  - {name: small, aliases: [s], version: "7"}
cache:
  opt_in_tenants: [c]
  shared_namespaces: [{name: docs, tenants: [a, d]}]
""")


def request(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "small", "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "How far is 5 km in miles?"}],
    }
    body.update(overrides)
    return body


def key(body: dict[str, Any], tenant: str = "b", policy: Policy = POLICY) -> str:
    return cache_keys(tenant, body, policy).exact


BASE = key(request())


@pytest.mark.parametrize("same", [
    request(stream=True),
    request(stream=True, stream_options={"include_usage": True}),
    request(user="someone-else", metadata={"trace": "x"}),
    request(model="s"),  # an alias of the same model
    request(temperature=0.0, top_p=1, n=1, presence_penalty=0, logprobs=False, stop=[]),
    request(frequency_penalty=0.0, logit_bias={}),  # asks for nothing, like leaving it out
    request(messages=[{"role": "system", "content": "  Be   brief. "},
                      {"role": "user", "content": "How far is\n5 km in miles?\t"}]),
    request(messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                      {"role": "user", "content": [{"type": "text", "text": "How far is"},
                                                   {"type": "text", "text": "5 km in miles?"}]}]),
])
def test_transport_fields_defaults_and_whitespace_keep_the_key(same: dict[str, Any]) -> None:
    assert key(same) == BASE


@pytest.mark.parametrize("different", [
    request(model="other"),
    request(temperature=0.5),
    request(top_p=0.9),
    request(max_tokens=16),
    request(max_completion_tokens=16),
    request(seed=1),
    request(stop="\n"),
    request(presence_penalty=0.5),
    request(frequency_penalty=0.5),
    request(logit_bias={"50256": -100}),
    request(logprobs=True),
    request(tools=[{"type": "function", "function": {"name": "f"}}]),
    request(tool_choice="none"),
    request(response_format={"type": "json_object"}),
    request(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}}}),
    request(logprobs=True, top_logprobs=2),
    request(n=2),
    request(tool_choice={"type": "function", "function": {"name": "f"}}),
    request(parallel_tool_calls=False),
    request(messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "How far is 5 km in miles?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "f", "arguments": "{}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "8 km"}]),
    request(messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "How far is 50 km in miles?"}]),
    request(messages=[{"role": "system", "content": "Be verbose."},
                      {"role": "user", "content": "How far is 5 km in miles?"}]),
    request(messages=[{"role": "user", "content": "How far is 5 km in miles?"}]),
    request(messages=[{"role": "system", "content": "Be brief."},
                      {"role": "assistant", "content": "How far is 5 km in miles?"}]),
    request(messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "how far is 5 km in miles?"}]),  # case kept
])
def test_output_changing_fields_change_the_key(different: dict[str, Any]) -> None:
    assert key(different) != BASE


def test_tenants_are_isolated_unless_they_share_a_namespace() -> None:
    assert key(request(), "a") != key(request(), "b")
    assert key(request(), "a") == key(request(), "d")  # both in the shared "docs" namespace
    assert cache_keys("a", request(), POLICY).namespace == "shared:docs"


def test_a_new_model_version_invalidates_its_keys() -> None:
    bumped = parse_policy_document(
        "models: [{name: small, aliases: [s], version: '8'}]\n")
    same_version = parse_policy_document(
        "models: [{name: small, aliases: [s], version: '7'}]\n")
    assert key(request(), policy=bumped) != key(request(), policy=same_version)


def test_semantic_namespace_ignores_only_the_last_user_message() -> None:
    one = cache_keys("b", request(), POLICY)
    other = cache_keys("b", request(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many miles is 5 km?"}]), POLICY)
    new_context = cache_keys("b", request(messages=[
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "How far is 5 km in miles?"}]), POLICY)
    assert one.semantic_namespace == other.semantic_namespace
    assert one.exact != other.exact
    assert new_context.semantic_namespace != one.semantic_namespace
    assert one.question == "How far is 5 km in miles?"
    assert cache_keys("b", request(max_tokens=5), POLICY).semantic_namespace != one.semantic_namespace


@pytest.mark.parametrize("question", [
    "如何做红烧肉", "日本の首都はどこですか", "서울의 인구는?", "Как удалить мой аккаунт?",
])
def test_questions_outside_latin_script_are_matched_exactly_only(question: str) -> None:
    # MiniLM is an English model and the guards read a-z words: in these
    # scripts unrelated questions score above the threshold ("日本の首都" /
    # "フランスの首都" 0.78), so they never take a semantic answer.
    keys = cache_keys("b", request(messages=[{"role": "user", "content": question}]), POLICY)
    assert keys.question is None
    assert keys.exact  # the exact cache still answers a repeat


@pytest.mark.parametrize("question", ["How far is 5 km in miles?", "où est la gare la plus proche?",
                                      "Wie spät ist es in Zürich?"])
def test_latin_script_questions_keep_semantic_matching(question: str) -> None:
    keys = cache_keys("b", request(messages=[{"role": "user", "content": question}]), POLICY)
    assert keys.question == question


def test_text_completions_are_keyed_by_prompt() -> None:
    text = {"model": "small", "prompt": "Once  upon a time", "temperature": 0}
    assert key(text) == key({**text, "prompt": "Once upon a time "})
    assert key(text) != key({**text, "prompt": "Once upon a rhyme"})
    assert cache_keys("b", text, POLICY).question == "Once upon a time"


def test_only_deterministic_requests_are_cacheable_unless_opted_in() -> None:
    assert cacheable("b", request(), POLICY)
    assert cacheable("b", request(temperature=0.8, seed=42), POLICY)
    assert not cacheable("b", request(temperature=0.8), POLICY)
    assert not cacheable("b", {k: v for k, v in request().items() if k != "temperature"}, POLICY)
    assert cacheable("c", request(temperature=0.8), POLICY)  # opted-in tenant
    assert not cacheable("b", request(store=True), POLICY)  # a side effect: never skipped
    off = parse_policy_document("cache: {enabled: false}\n")
    assert not cacheable("b", request(), off)
    everything = parse_policy_document("cache: {deterministic_only: false}\n")
    assert cacheable("b", request(temperature=1.2), everything)


def test_cache_control_headers() -> None:
    assert bypasses_lookup({"cache-control": "no-cache"})
    assert bypasses_lookup({"cache-control": "No-Store"})
    assert not bypasses_lookup({"cache-control": "max-age=0"}) and not bypasses_lookup({})
    assert forbids_store({"cache-control": "no-store"})
    assert not forbids_store({"cache-control": "no-cache"})


def test_a_tenant_in_two_shared_namespaces_is_rejected_with_its_location() -> None:
    from policies.schema import PolicyError

    with pytest.raises(PolicyError) as caught:
        parse_policy_document(
            "cache:\n  shared_namespaces:\n    - {name: x, tenants: [a]}\n"
            "    - {name: y, tenants: [b, a]}\n", "p.yaml")
    assert "cache.shared_namespaces[1].tenants[1]" in str(caught.value)
    assert "more than one shared namespace" in str(caught.value)
