"""Cache keys: what makes two requests the same question (sans-IO, pure).

The exact key is a blake2b digest of a canonical form of the request: the
cache namespace (the tenant, unless the policy shares it), the canonical model
name and its policy version (so a version bump invalidates), the messages
(role + whitespace-normalized text, content-part lists included) and every
parameter that changes the output. Transport-only fields (``stream``,
``stream_options``, ``user``, ``metadata``, ...) never enter the key, so a
streaming and a non-streaming client share entries.

The semantic namespace is the same digest without the last user message: two
questions are compared only when everything around them (tenant, model,
parameters, system prompt, earlier turns) is identical.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from policies.schema import Policy

KEY_VERSION = "v1"  # bump when the canonical form changes

# Parameters that change what the model answers; anything else is transport.
OUTPUT_PARAMS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "repeat_penalty", "logit_bias", "logprobs",
    "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
    "parallel_tool_calls", "reasoning_effort", "modalities", "prediction", "suffix", "echo",
    "best_of", "grammar", "json_schema",
)
# The OpenAI defaults: leaving a parameter out and sending its default is one request.
PARAM_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "n": 1, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "logprobs": False, "stop": None, "seed": None,
    "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None,
    "parallel_tool_calls": None,
}

_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Runs of whitespace become one space; leading and trailing space goes."""
    return _SPACE.sub(" ", text).strip()


@dataclass(frozen=True)
class CacheKeys:
    """The keys of one cacheable request."""

    namespace: str  # "tenant:NAME" or "shared:NAME"
    model: str  # canonical
    exact: str  # hex digest
    semantic_namespace: str  # hex digest of everything but the question
    question: str | None  # the last user message (normalized); None: no semantic lookup


def canonical_messages(messages: Any) -> list[tuple[str, Any]]:
    if not isinstance(messages, list):
        return []
    return [_canonical_message(m) for m in messages if isinstance(m, Mapping)]


def _canonical_message(message: Mapping[str, Any]) -> tuple[str, Any]:
    role = str(message.get("role", ""))
    extras = {k: message[k] for k in ("name", "tool_calls", "tool_call_id") if message.get(k)}
    content = _canonical_content(message.get("content"))
    return (role, [content, extras] if extras else content)


def _canonical_content(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return normalize_text(content)
    if isinstance(content, list):
        parts = [_canonical_part(p) for p in content]
        # A list of text parts is the same question as their concatenation.
        if all(isinstance(p, str) for p in parts):
            return normalize_text(" ".join(parts))
        return parts
    return content


def _canonical_part(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") == "text":
        return normalize_text(str(part.get("text", "")))
    return part


def output_params(request: Mapping[str, Any]) -> dict[str, Any]:
    """The output-changing parameters, defaults dropped, stop as a list."""
    params: dict[str, Any] = {}
    for name in OUTPUT_PARAMS:
        value = request.get(name)
        if name == "stop" and isinstance(value, str):
            value = [value]
        # An empty stop list or logit_bias map asks for nothing, like leaving it out.
        if value is None or value == PARAM_DEFAULTS.get(name, object()) or value in ([], {}):
            continue
        numeric = name in ("temperature", "top_p") and isinstance(value, (int, float))
        params[name] = float(value) if numeric else value
    limit = request.get("max_completion_tokens") or request.get("max_tokens")
    if limit is not None:
        params["max_tokens"] = limit
    return params


def last_user_message(messages: list[tuple[str, Any]]) -> str | None:
    if messages and messages[-1][0] == "user" and isinstance(messages[-1][1], str):
        return messages[-1][1]
    return None


# MiniLM (all-MiniLM-L6-v2) was trained on English, and the guards read only
# a-z words: in other scripts unrelated questions score above the threshold
# ("日本の首都" / "フランスの首都" 0.78) and no guard sees the difference.
MAX_NON_LATIN_LETTERS = 0.2  # share of a question's letters; above it: exact matches only


def semantic_question(text: str | None) -> str | None:
    """The question a semantic lookup may match on, or None: exact matches only."""
    if not text:
        return None
    letters = [c for c in text if c.isalpha()]
    foreign = sum(1 for c in letters if not c.isascii())
    if letters and foreign > MAX_NON_LATIN_LETTERS * len(letters):
        return None
    return text


def _digest(material: Any) -> str:
    data = orjson.dumps(material, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def cache_keys(tenant: str, request: Mapping[str, Any], policy: Policy) -> CacheKeys:
    """Keys for a chat (``messages``) or text (``prompt``) completion request."""
    namespace = policy.cache.namespace_of(tenant)
    model = policy.canonical_model(str(request.get("model", "")))
    head = [KEY_VERSION, namespace, model, policy.model_version(model), output_params(request)]
    if "messages" in request:
        messages = canonical_messages(request.get("messages"))
        question = last_user_message(messages)
        context: Any = ["chat", messages[:-1] if question is not None else messages]
        whole: Any = ["chat", messages]
    else:
        prompt = request.get("prompt")
        question = normalize_text(prompt) if isinstance(prompt, str) else None
        context = ["text", None if question is not None else prompt]
        whole = ["text", question if question is not None else prompt]
    return CacheKeys(namespace, model, _digest([*head, whole]), _digest([*head, context]),
                     semantic_question(question))


def deterministic(request: Mapping[str, Any]) -> bool:
    """Temperature 0 or a fixed seed: the same request gives the same answer."""
    temperature = request.get("temperature", 1.0)
    return temperature == 0 or request.get("seed") is not None


def cacheable(tenant: str, request: Mapping[str, Any], policy: Policy) -> bool:
    """Whether this request may be answered from, and stored in, the cache."""
    cache = policy.cache
    if not cache.enabled or request.get("store") is True or (request.get("n") or 1) != 1:
        return False
    if not cache.deterministic_only or deterministic(request):
        return True
    model = policy.canonical_model(str(request.get("model", "")))
    return tenant in cache.opt_in_tenants or model in cache.opt_in_models


def bypasses_lookup(headers: Mapping[str, str]) -> bool:
    """``cache-control: no-cache`` (or no-store): answer fresh, never from the cache."""
    value = headers.get("cache-control", "").lower()
    return "no-cache" in value or "no-store" in value


def forbids_store(headers: Mapping[str, str]) -> bool:
    return "no-store" in headers.get("cache-control", "").lower()
