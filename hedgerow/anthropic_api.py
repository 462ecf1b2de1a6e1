"""Anthropic's Messages API request, translated onto the OpenAI chat request (sans-IO).

``POST /v1/messages`` is served by the same path as ``/v1/chat/completions``
(admission, cache, EDF queue, hedging, workers): ``openai_request`` checks an
Anthropic request field by field (``hedgerow.api_params.MESSAGES_PARAMS``:
every field is implemented, carried, accepted or refused by name, never
dropped), validates its types as strictly as Anthropic does, and returns the
equivalent OpenAI chat request as a plain dict. The chat path then validates
that dict as any chat request; its answer is turned back into Anthropic's
shapes by ``hedgerow.anthropic_reply``.

The translation, as LiteLLM, vLLM and llama-server do it:

- ``system`` (a string or text blocks) is the first message, role ``system``;
- text blocks are joined a line each, as OpenAI's text parts are;
- an assistant's ``tool_use`` blocks are its ``tool_calls`` (``input`` as
  JSON ``arguments``); a user's ``tool_result`` blocks are ``tool`` messages
  (before the rest of that turn's text), ``is_error`` prefixed ``Error: ``;
- ``tools`` are OpenAI function tools (``input_schema`` is ``parameters``);
  ``tool_choice`` ``auto``/``any``/``tool``/``none`` is ``auto``/``required``/
  the named function/``none``; ``disable_parallel_tool_use`` is
  ``parallel_tool_calls: false``;
- ``stop_sequences`` is ``stop``, ``metadata.user_id`` is ``user``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hedgerow import openai_api as oa
from hedgerow.api_params import (
    MESSAGES_PARAMS,
    MAX_NAME_SHOWN,
    check_fields,
    unsupported,
)
from hedgerow.errors import InvalidRequest
from hedgerow.pydantic_errors import invalid_value

# Anthropic's own bounds are larger; these are Hedgerow's (the chat path's).
MAX_MESSAGES = oa.MAX_MESSAGES
MAX_STOP = oa.MAX_STOP
MAX_TOOLS = 128  # OpenAI's bound on tools
ANTHROPIC_VERSION = "2023-06-01"  # the earliest version whose shapes are served

StrictText = Annotated[str, Field(strict=True)]
ToolName = Annotated[str, Field(strict=True, pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
ToolUseId = Annotated[str, Field(strict=True, min_length=1, max_length=256)]
BLOCK_TYPES = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictText
    # A prompt-caching hint for Anthropic's servers; it cannot change an answer.
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = Field(None, max_length=0)


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: ToolUseId
    name: ToolName
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: ToolUseId
    content: StrictText | list[TextBlock] | None = None
    is_error: Annotated[bool, Field(strict=True)] | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = _joined(self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: StrictText | list[Block]


class Tool(_Strict):
    name: ToolName
    description: StrictText | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: Annotated[bool, Field(strict=True)] | None = None


class Metadata(_Strict):
    user_id: Annotated[str, Field(strict=True, max_length=256)] | None = None


class MessagesRequest(_Strict):
    model: str = Field(min_length=1, max_length=256, strict=True)
    max_tokens: int = Field(ge=1, strict=True)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: StrictText | list[TextBlock] | None = None
    stop_sequences: list[StrictText] | None = Field(None, max_length=MAX_STOP)
    stream: bool = Field(False, strict=True)
    # Anthropic's temperature runs from 0 to 1 (OpenAI's to 2): the same scale below 1.
    temperature: float | None = Field(None, ge=0.0, le=1.0, strict=True)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True)
    metadata: Metadata | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    # Refused unless they ask for nothing (api_params): only those values get here.
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    output_config: dict[str, Any] | None = None
    top_k: None = None
    # Accepted, unused: they cannot change an answer.
    cache_control: dict[str, Any] | None = None
    user_profile_id: Annotated[str, Field(strict=True, max_length=256)] | None = None
    workspace_id: Annotated[str, Field(strict=True, max_length=256)] | None = None


def openai_request(body: bytes) -> dict[str, Any]:
    """The OpenAI chat request equivalent to an Anthropic Messages request body,
    or ``InvalidRequest`` naming the Anthropic field at fault."""
    data = oa.decode_request(body)
    return to_openai(parse(data))


def parse(data: Mapping[str, Any]) -> MessagesRequest:
    check_fields(data, MESSAGES_PARAMS, "")
    _check_blocks(data.get("messages"))
    _check_tools(data.get("tools"))
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as error:
        raise invalid_value(error) from None


def _check_blocks(messages: Any) -> None:
    """Content blocks Hedgerow cannot carry (images, documents, thinking …) are
    refused by name, before type validation could call them malformed."""
    if not isinstance(messages, list):
        return
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), list):
            continue
        allowed = BLOCK_TYPES.get(str(message.get("role")), ())
        for place, block in enumerate(message["content"]):
            kind = block.get("type") if isinstance(block, Mapping) else None
            if isinstance(kind, str) and kind not in allowed:
                shown = kind[:MAX_NAME_SHOWN]
                raise unsupported(f"messages.{index}.content.{place}",
                                  f"{shown!r} blocks in a {message.get('role')} turn: text, "
                                  "tool_use (assistant) and tool_result (user) only")


def _check_tools(tools: Any) -> None:
    """Anthropic's server tools (web search, code execution …) run on Anthropic's side."""
    if not isinstance(tools, list):
        return
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind not in (None, "custom"):
            raise unsupported(f"tools.{index}.type",
                              f"server tools ({str(kind)[:MAX_NAME_SHOWN]!r}): custom tools only")


def to_openai(request: MessagesRequest) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        messages.append({"role": "system", "content": _joined(request.system)})
    for index, message in enumerate(request.messages):
        messages.extend(_openai_messages(message))
    if request.messages[-1].role == "assistant":
        # Anthropic continues a final assistant turn (prefill); a chat template
        # would start a new one: a different answer, so refused.
        raise unsupported(f"messages.{len(request.messages) - 1}.role",
                          "a final assistant turn (prefill) is not continued")
    out: dict[str, Any] = {"model": request.model, "messages": messages,
                           "max_tokens": request.max_tokens, "stream": request.stream}
    if request.stream:
        # The usage closes Anthropic's stream (message_delta): always ask for it.
        out["stream_options"] = {"include_usage": True}
    if request.temperature is not None:
        out["temperature"] = request.temperature
    if request.top_p is not None:
        out["top_p"] = request.top_p
    if request.stop_sequences:
        out["stop"] = list(request.stop_sequences)
    if request.metadata is not None and request.metadata.user_id is not None:
        out["user"] = request.metadata.user_id
    out.update(_openai_tools(request))
    return out


def _openai_messages(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    if message.role == "assistant":
        calls = [_tool_call(b) for b in message.content if isinstance(b, ToolUseBlock)]
        shaped: dict[str, Any] = {"role": "assistant",
                                  "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            shaped["tool_calls"] = calls
        return [shaped]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in message.content if isinstance(b, ToolResultBlock)]
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _tool_call(block: ToolUseBlock) -> dict[str, Any]:
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": orjson.dumps(block.input).decode()}}


def _openai_tools(request: MessagesRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if request.tools:
        out["tools"] = [{"type": "function", "function": _function(tool)}
                        for tool in request.tools]
    choice = request.tool_choice
    if choice is None:
        return out
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest("tool_choice.name: required when tool_choice.type is 'tool'",
                                 param="tool_choice.name", code="invalid_value")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use and request.tools:
        out["parallel_tool_calls"] = False
    return out


def _function(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return function


def _joined(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(block.text for block in content)


def check_version(header: str | None) -> None:
    """``anthropic-version``: optional here (see README). Any dated version from
    2023-06-01 on is served with that version's shapes (later ones added
    fields, which the field tables refuse or accept by name); an earlier one
    (2023-01-01 streamed differently) or one that is no date is a 400."""
    if header is None:
        return
    version = header.strip()
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", version, re.ASCII) and version >= ANTHROPIC_VERSION:
        return
    raise InvalidRequest(f"anthropic-version: {version[:MAX_NAME_SHOWN]!r} is not served; "
                         f"Hedgerow speaks {ANTHROPIC_VERSION} and later",
                         param="anthropic-version", code="invalid_value")
