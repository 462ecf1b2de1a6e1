"""The OpenAI-compatible request and response shapes Hedgerow speaks.

Every field a client sends is honoured or refused, never dropped:
``hedgerow.api_params`` says, field by field, whether Hedgerow implements
it, carries it to the worker, accepts it as harmless, or refuses it with a
400 ``unsupported_parameter`` (fields OpenAI does not define:
``unknown_parameter``). The models here then check types and ranges, strict
where OpenAI's are. Every parse error is an ``InvalidRequest`` naming the
offending parameter.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from hedgerow.api_params import check_request
from hedgerow.errors import InvalidRequest

MAX_MESSAGES = 512
MAX_STOP = 4
# Objects and arrays nested deeper than this are refused (400). Real requests
# nest a few levels (tool schemas a dozen or so); orjson's own bound is 1024.
MAX_JSON_DEPTH = 64
MAX_LOGIT_BIAS = 300  # token entries; Hedgerow's bound
MAX_METADATA = 16  # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512
# Any other field may be null, which means the same as leaving it out
# (OpenAI's fields are nullable). Not these: without them a request means
# nothing, and "stream": null is refused as no boolean, never a silent false.
NOT_NULLABLE = ("model", "messages", "prompt", "stream")

# Strict (no coercion from other JSON types), for use inside unions.
StrictText = Annotated[str, Field(strict=True)]
ShortText = Annotated[str, Field(strict=True, max_length=256)]
LongText = Annotated[str, Field(strict=True, max_length=1024)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str = Field(strict=True)


# OpenAI's rule for function names; it also keeps them safe inside a grammar.
FunctionName = Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_-]{1,64}$")]
MAX_TOOLS = 128  # OpenAI's bound
MAX_CHOICES = 128  # n: OpenAI's bound
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    description: Annotated[str, Field(strict=True, max_length=8192)] | None = None
    # A JSON Schema object; the worker turns it into a grammar (an empty or
    # missing one means "no arguments": ``{}``).
    parameters: dict[str, Any] | None = None
    strict: Annotated[bool, Field(strict=True)] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    arguments: StrictText  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: ShortText
    type: Literal["function"]
    function: CalledFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: FunctionName
    description: Annotated[str, Field(strict=True, max_length=8192)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Annotated[bool, Field(strict=True)] | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class ChatMessage(BaseModel):
    # Fields other than these are refused by ``api_params`` before validation.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictText | list[TextPart] | None = None
    name: ShortText | None = None
    # A tool conversation's turns reach the model (and the cache key) whole.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: ShortText | None = None

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message (and only one) names its tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        # Text parts are one message, a line each (as vLLM joins them).
        return "\n".join(part.text for part in self.content)

    def for_model(self) -> dict[str, Any]:
        """What a chat template gets: role, text, the participant's name if
        given, and a tool conversation's calls and call ids."""
        shaped: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            shaped["name"] = self.name
        if self.tool_calls:
            shaped["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            shaped["tool_call_id"] = self.tool_call_id
        return shaped


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # see api_params.STREAM_OPTIONS
    include_usage: bool = Field(False, strict=True)
    include_obfuscation: bool = Field(False, strict=True)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    # Strict as OpenAI's API is: "stream": "yes" (or "true", or 1) is a 400,
    # never a silent true, and "max_tokens": "5" is no integer. A float field
    # still takes a JSON integer (temperature 1), as OpenAI's does.
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
    seed: int | None = Field(None, strict=True)
    stop: StrictText | list[StrictText] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, strict=True)
    # Token id (a decimal string, as OpenAI's) -> bias in [-100, 100]; the
    # worker checks the ids against its model's vocabulary.
    logit_bias: dict[str, Annotated[int, Field(strict=True)]] | None = None
    # Choices, generated one after another on one worker (OpenAI's bound: 128).
    n: int = Field(1, ge=1, le=MAX_CHOICES, strict=True)
    # OpenAI's stored completions: only false gets here (Hedgerow stores
    # nothing). Were true let through, such a request must never be hedged.
    store: bool = Field(False, strict=True)
    user: LongText | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in value.items():
            if not (token.isascii() and token.isdigit() and len(token) <= 9):
                raise ValueError(f"keys are token ids (decimal integers), not {token[:32]!r}")
            if not -100 <= bias <= 100:
                raise ValueError("biases are integers from -100 to 100")
        return value

    def token_biases(self) -> tuple[tuple[int, int], ...]:
        return tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    # Accepted, not used: they cannot change an answer (api_params).
    metadata: dict[str, StrictText] | None = None
    safety_identifier: Annotated[str, Field(strict=True, max_length=128)] | None = None
    prompt_cache_key: LongText | None = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)

    @model_validator(mode="after")
    def _consistent_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions share a name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def tool_mode(self) -> str | None:
        """None (plain text), "auto", "required" or the name of the function to call."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return "function:" + choice.function.name
        return choice or "auto"

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > MAX_METADATA or any(
                len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError(f"at most {MAX_METADATA} pairs, keys of at most 64 characters "
                             "and values of at most 512")
        return value

    def message_chars(self) -> tuple[int, ...]:
        """Text characters in each message (what the policy's limits bound)."""
        return tuple(len(m.text()) for m in self.messages)


class CompletionRequest(_Sampling):
    prompt: str = Field(max_length=1_000_000, strict=True)

    def message_chars(self) -> tuple[int, ...]:
        return (len(self.prompt),)


R = TypeVar("R", bound=_Sampling)


def parse_request(body: bytes, model: type[R]) -> R:
    """Decode and validate a request body, or raise ``InvalidRequest``."""
    return validate_request(decode_request(body), model)


def decode_request(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (not yet validated), or ``InvalidRequest``.

    The gateway decodes a body once and hands the dict to validation, the
    cache key and the upstream body alike.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if nested_deeper_than(data, MAX_JSON_DEPTH):
        raise InvalidRequest(f"request body nests objects or arrays more than {MAX_JSON_DEPTH} "
                             "levels deep", code="json_too_deep")
    return data


def validate_request(data: dict[str, Any], model: type[R]) -> R:
    """Validate a decoded body (``decode_request``), or raise ``InvalidRequest``.

    ``data`` itself is left as it is: the gateway forwards it to the worker."""
    check_request(data, chat=issubclass(model, ChatCompletionRequest))
    given = {k: v for k, v in data.items() if v is not None or k in NOT_NULLABLE}
    try:
        return model.model_validate(given)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = f"invalid value for {param!r}: {first['msg']}" if param else first["msg"]
        raise InvalidRequest(message, param=param, code="invalid_value") from None


def nested_deeper_than(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether ``value`` nests dicts/lists more than ``limit`` levels (no recursion)."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def completion_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": completion_id(request_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": finish_reason}],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_chunk(request_id: str, model: str, created: int, used: dict[str, int]) -> dict[str, Any]:
    return {
        "id": completion_id(request_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": used,
    }


def chat_completion(
    request_id: str, model: str, created: int, text: str, finish_reason: str, used: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": completion_id(request_id),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": used,
    }


def chat_completion_of(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]],
    used: dict[str, int],
) -> dict[str, Any]:
    """A whole chat completion from finished choices (``CompletionFold.chat_choices``)."""
    return {"id": completion_id(request_id), "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": used}


def text_completion_of(
    request_id: str, model: str, created: int, choices: list[dict[str, Any]],
    used: dict[str, int],
) -> dict[str, Any]:
    """A whole text completion from finished choices (``CompletionFold.text_choices``)."""
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created,
            "model": model, "choices": choices, "usage": used}


def text_chunk(
    request_id: str, model: str, created: int, text: str, finish_reason: str | None = None
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def text_completion(
    request_id: str, model: str, created: int, text: str, finish_reason: str, used: dict[str, int]
) -> dict[str, Any]:
    body = text_chunk(request_id, model, created, text, finish_reason)
    body["usage"] = used
    return body


def error_event(message: str, error_type: str, code: str) -> dict[str, Any]:
    """The SSE event that ends a stream which failed after it started."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def now_created() -> int:
    return int(time.time())
