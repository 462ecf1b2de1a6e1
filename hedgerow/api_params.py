"""What Hedgerow does with each field of an OpenAI request: nothing is dropped silently.

Every field of OpenAI's chat-completions and (legacy) completions requests
(the reference is the official SDK's ``completion_create_params``) is one of:

- ``implemented``: Hedgerow acts on it itself (``model``, ``stream``, ...);
- ``carried``: handed to the model worker, which honours it (sampling);
- ``accepted``: it cannot change the answer (``user``, ``metadata``): checked
  for its type, forwarded to external upstreams, otherwise unused;
- ``refused``: a 400 ``unsupported_parameter`` naming it, unless the value
  asks for nothing (``n: 1``, ``logprobs: false``, ``tool_choice: "none"``).

``null`` is the same as leaving a field out (OpenAI's fields are nullable).
A field OpenAI does not define is a 400 ``unknown_parameter``, as OpenAI
answers "Unrecognized request argument". README's "Request parameters"
table says the same for users; a unit test keeps both in step with the SDK.

Checked before the pydantic models validate types, so a refusal always names
the field; what the check lets through is typed and ranged by the models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hedgerow.errors import InvalidRequest

Support = Literal["implemented", "carried", "accepted", "refused"]
MAX_NAME_SHOWN = 64  # a field name echoed in an error is cut to this


def _anything(value: Any) -> bool:
    return True


def _only(*values: Any) -> Callable[[Any], bool]:
    """Accepts exactly these JSON values (``true`` is not ``1``)."""
    def accepts(value: Any) -> bool:
        return any(value == v and type(value) is type(v) for v in values)
    return accepts


def _at_most_one(value: Any) -> bool:
    # n / best_of: only a count above 1 asks for what Hedgerow lacks; a value
    # of the wrong type or range is the model's invalid_value 400.
    return not (type(value) is int and value > 1)


@dataclass(frozen=True)
class Param:
    support: Support
    accepts: Callable[[Any], bool] = _anything  # for "refused": the no-op values
    why: str = ""  # appended to a refusal's message


def _refused(why: str, *noop: Any) -> Param:
    return Param("refused", _only(*noop) if noop else (lambda value: False), why)


_LEGACY_FUNCTIONS = "the deprecated functions API: send tools and tool_choice"
_NO_LOGPROBS = "log probabilities are returned by chat completions only"

_SHARED: dict[str, Param] = {
    "model": Param("implemented"),
    "stream": Param("implemented"),
    "stream_options": Param("implemented"),
    "max_tokens": Param("carried"),
    "temperature": Param("carried"),
    "top_p": Param("carried"),
    "seed": Param("carried"),
    "stop": Param("carried"),
    "presence_penalty": Param("carried"),
    "frequency_penalty": Param("carried"),
    "logit_bias": Param("carried"),
    "n": Param("carried"),
    "user": Param("accepted"),
}

CHAT_PARAMS: dict[str, Param] = {
    **_SHARED,
    "messages": Param("implemented"),
    "max_completion_tokens": Param("carried"),
    "store": _refused("Hedgerow keeps no stored completions", False),
    "metadata": Param("accepted"),
    "safety_identifier": Param("accepted"),
    "prompt_cache_key": Param("accepted"),
    # At most one call per answer, which both values allow.
    "parallel_tool_calls": Param("accepted"),
    "logprobs": Param("carried"),
    "top_logprobs": Param("carried"),
    "tools": Param("carried"),
    "tool_choice": Param("carried"),
    "functions": _refused(_LEGACY_FUNCTIONS),
    "function_call": _refused(_LEGACY_FUNCTIONS, "none"),
    "response_format": Param("carried"),
    "audio": _refused("text output only"),
    "modalities": _refused("text output only", ["text"]),
    "prediction": _refused("predicted outputs are not implemented"),
    "reasoning_effort": _refused("no reasoning models are served"),
    "verbosity": _refused("no model here takes a verbosity setting"),
    "web_search_options": _refused("web search is not implemented"),
    "moderation": _refused("moderation is not implemented"),
    "service_tier": _refused("there is one service tier", "auto", "default"),
    "prompt_cache_retention": _refused("prompt-cache retention cannot be chosen"),
    "prompt_cache_options": _refused("prompt-cache retention cannot be chosen"),
}

COMPLETION_PARAMS: dict[str, Param] = {
    **_SHARED,
    "prompt": Param("implemented"),
    "best_of": Param("refused", _at_most_one, "one candidate per request (best_of: 1)"),
    "echo": _refused("the prompt is not echoed", False),
    "suffix": _refused("insertion (suffix) is not implemented", ""),
    "logprobs": _refused(_NO_LOGPROBS),  # 0 still asks for the sampled tokens' logprobs
}

STREAM_OPTIONS: dict[str, Param] = {
    "include_usage": Param("implemented"),
    "include_obfuscation": _refused("streams are not padded", False),
}

# Message fields by role. A tool conversation's turns (assistant tool calls,
# tool results) reach the model; the deprecated function messages are
# refused rather than dropped: answering without them would be a wrong answer
# with a 200.
_MESSAGE_COMMON = {"role", "content", "name"}
_BY_ROLE: dict[str, dict[str, Param]] = {
    "assistant": {
        "tool_calls": Param("carried"),
        "function_call": _refused(_LEGACY_FUNCTIONS),
        "refusal": _refused("an assistant turn's refusal is not carried"),
        "audio": _refused("text only"),
    },
    "tool": {"tool_call_id": Param("carried")},
}
_REFUSED_ROLES = {"function": _LEGACY_FUNCTIONS}
_TEXT_PART_FIELDS = {"type", "text"}


def check_request(data: Mapping[str, Any], chat: bool) -> None:
    """Raise ``InvalidRequest`` naming the first field Hedgerow would not honour."""
    check_fields(data, CHAT_PARAMS if chat else COMPLETION_PARAMS, "")
    options = data.get("stream_options")
    if isinstance(options, Mapping):
        check_fields(options, STREAM_OPTIONS, "stream_options.")
    if not chat and isinstance(data.get("prompt"), list):
        raise _unsupported("prompt", "one string prompt per request, not a batch or token ids")
    messages = data.get("messages")
    if chat and isinstance(messages, list):
        for index, message in enumerate(messages):
            if isinstance(message, Mapping):
                check_message(message, f"messages.{index}")


def check_fields(data: Mapping[str, Any], params: Mapping[str, Param], prefix: str) -> None:
    for name in data:
        if name not in params:
            raise _unknown(prefix + name)
    # In the table's order, so the error names the same field whatever order
    # a client serialised them in (tools before tool_choice).
    for name, param in params.items():
        value = data.get(name)
        if param.support == "refused" and value is not None and not param.accepts(value):
            raise _unsupported(prefix + name, param.why)


def check_message(message: Mapping[str, Any], where: str) -> None:
    role = message.get("role")
    if isinstance(role, str) and role in _REFUSED_ROLES:
        raise _unsupported(f"{where}.role", f"{role!r} messages: {_REFUSED_ROLES[role]}")
    for name, value in message.items():
        # A null field says nothing (SDKs echo a response's message with nulls).
        if name in _MESSAGE_COMMON or value is None:
            continue
        param = _BY_ROLE.get(role, {}).get(name) if isinstance(role, str) else None
        if param is None:
            raise _unknown(f"{where}.{name}")
        if not param.accepts(value):
            raise _unsupported(f"{where}.{name}", param.why)
    content = message.get("content")
    if isinstance(content, list):
        for index, part in enumerate(content):
            if isinstance(part, Mapping):
                _check_part(part, f"{where}.content.{index}")


def _check_part(part: Mapping[str, Any], where: str) -> None:
    kind = part.get("type")
    if kind != "text":
        shown = str(kind)[:MAX_NAME_SHOWN]
        raise _unsupported(where, f"content parts of type {shown!r}: text parts only")
    for name in part:
        if name not in _TEXT_PART_FIELDS:
            raise _unsupported(f"{where}.{name}", "text parts carry only type and text")


def _unknown(param: str) -> InvalidRequest:
    shown = param[:MAX_NAME_SHOWN]
    return InvalidRequest(f"Unrecognized request argument supplied: {shown}",
                          param=shown, code="unknown_parameter")


def _unsupported(param: str, why: str) -> InvalidRequest:
    shown = param[:MAX_NAME_SHOWN]
    reason = f" ({why})" if why else ""
    return InvalidRequest(f"Hedgerow does not support {shown!r} with this value{reason}",
                          param=shown, code="unsupported_parameter")


def unsupported(param: str, why: str) -> InvalidRequest:
    """The 400 ``unsupported_parameter`` naming ``param`` (for other modules' checks)."""
    return _unsupported(param, why)


# -- the other endpoints ---------------------------------------------------------------

_MESSAGES_ONLY = "a Messages API feature Hedgerow does not serve"

# Anthropic's Messages API (``POST /v1/messages``; the reference is the
# official ``anthropic`` SDK's ``MessageCreateParams``, with the fields its
# earlier versions sent: ``temperature``, ``top_p``, ``top_k`` …), translated
# onto the chat path by ``hedgerow.anthropic_api``: "carried" fields reach the
# worker as their OpenAI equivalents, so the chat path's own support applies.
MESSAGES_PARAMS: dict[str, Param] = {
    "model": Param("implemented"),
    "messages": Param("implemented"),
    "system": Param("implemented"),
    "stream": Param("implemented"),
    "max_tokens": Param("carried"),
    "stop_sequences": Param("carried"),
    "temperature": Param("carried"),
    "top_p": Param("carried"),
    "tools": Param("carried"),
    "tool_choice": Param("carried"),
    "metadata": Param("accepted"),
    "cache_control": Param("accepted"),  # a hint to Anthropic's prompt cache
    "user_profile_id": Param("accepted"),  # the SDK sends these two as headers
    "workspace_id": Param("accepted"),
    "top_k": _refused("the workers' OpenAI sampling has no top_k"),
    "thinking": _refused("no reasoning models are served", {"type": "disabled"}),
    "service_tier": _refused("there is one service tier", "auto", "standard_only"),
    "speed": _refused("there is one speed", "standard"),
    "output_config": _refused("effort and output formats are not translated", {}),
    "output_format": _refused("output formats are not translated"),
    "diagnostics": _refused("prompt-cache diagnostics are not returned"),
    "container": _refused(_MESSAGES_ONLY),
    "context_management": _refused(_MESSAGES_ONLY),
    "mcp_servers": _refused(_MESSAGES_ONLY),
    "inference_geo": _refused("there is one region"),
}

# OpenAI's embeddings (``POST /v1/embeddings``; ``embedding_create_params``).
EMBEDDINGS_PARAMS: dict[str, Param] = {
    "model": Param("implemented"),
    "input": Param("implemented"),
    "encoding_format": Param("implemented"),
    "dimensions": Param("implemented"),
    "user": Param("accepted"),
}

# Every route of the public API and what Hedgerow does with it.
ENDPOINTS: dict[str, Support] = {
    "POST /v1/chat/completions": "implemented",
    "POST /v1/completions": "implemented",
    "POST /v1/messages": "implemented",
    "POST /v1/embeddings": "implemented",
    "GET /v1/models": "implemented",
}
