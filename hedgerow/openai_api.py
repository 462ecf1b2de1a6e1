"""The OpenAI-compatible request and response shapes Hedgerow speaks.

Parsing is strict where a mistake would change the answer (types, ranges,
required fields) and lenient about fields Hedgerow does not use, because the
official SDKs send more than we need. Every parse error is an
``InvalidRequest`` naming the offending parameter.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hedgerow.errors import InvalidRequest

MAX_MESSAGES = 512
MAX_STOP = 4
# Objects and arrays nested deeper than this are refused (400). Real requests
# nest a few levels (tool schemas a dozen or so); orjson's own bound is 1024.
MAX_JSON_DEPTH = 64


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(False, strict=True)


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
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, strict=True)
    # OpenAI's stored completions: a side effect, so such a request is never hedged.
    store: bool = Field(False, strict=True)

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

    def message_chars(self) -> tuple[int, ...]:
        """Text characters in each message (what the policy's limits bound)."""
        return tuple(len(m.text()) for m in self.messages)


class CompletionRequest(_Sampling):
    prompt: str = Field(max_length=1_000_000)

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
    """Validate a decoded body (``decode_request``), or raise ``InvalidRequest``."""
    try:
        return model.model_validate(data)
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
) -> dict[str, Any]:
    return {
        "id": completion_id(request_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
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
