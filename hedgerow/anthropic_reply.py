"""The chat path's OpenAI answers, turned into Anthropic Messages API answers (sans-IO).

``message_of`` turns a ``chat.completion`` body into a ``message``;
``MessageStream`` turns the chunks of a streamed chat completion, one by
one, into Anthropic's SSE events::

    message_start
    content_block_start (text, or tool_use)   ┐
    ping                                      │ the first block only
    content_block_delta (text_delta, or       │ per block
                         input_json_delta)    │
    content_block_stop                        ┘
    message_delta (stop_reason, stop_sequence, usage)
    message_stop

An OpenAI ``{"error": ...}`` event (a failure after the first token) is
Anthropic's ``error`` event; a keep-alive comment is a ``ping``.

``stop_reason``: ``stop`` is ``end_turn``, ``length`` ``max_tokens``,
``tool_calls`` ``tool_use``. Whether a ``stop`` was one of the request's
``stop_sequences`` is known only when the worker says which (vLLM's
``stop_reason`` on the choice); otherwise it is ``end_turn``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from hedgerow.errors import UpstreamFailed, anthropic_error_body, anthropic_error_type

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}


def message_id(openai_id: str) -> str:
    return "msg_" + openai_id.removeprefix("chatcmpl-")


def tool_use_id(openai_id: str) -> str:
    """Anthropic's ids are ``toolu_…``; an id that came from a client (a
    previous turn's) is kept as it is, so a conversation's ids stay its own."""
    return openai_id if openai_id.startswith("toolu_") else "toolu_" + openai_id


def stop_of(choice: dict[str, Any], stop_sequences: Sequence[str]) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a finished OpenAI choice."""
    finish = choice.get("finish_reason") or "stop"
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def usage_of(used: Any) -> dict[str, int]:
    used = used if isinstance(used, dict) else {}
    return {"input_tokens": int(used.get("prompt_tokens") or 0),
            "output_tokens": int(used.get("completion_tokens") or 0)}


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's ``arguments`` (a JSON text) as Anthropic's ``input`` object."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise UpstreamFailed(f"tool call arguments are not a JSON object: {str(arguments)[:80]!r}",
                             code="upstream_malformed")
    return value


def message_of(completion: dict[str, Any], stop_sequences: Sequence[str] = ()) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` as an Anthropic ``message``."""
    choice = (completion.get("choices") or [{}])[0]
    said = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if said.get("content"):
        content.append({"type": "text", "text": said["content"]})
    for call in said.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": tool_use_id(str(call.get("id", ""))),
                        "name": function.get("name", ""),
                        "input": tool_input(function.get("arguments"))})
    stop_reason, stop_sequence = stop_of(choice, stop_sequences)
    return {"id": message_id(str(completion.get("id", ""))), "type": "message",
            "role": "assistant", "model": completion.get("model", ""), "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage_of(completion.get("usage"))}


def event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


PING = event("ping", {"type": "ping"})


def error_event(message: str, openai_type: str) -> bytes:
    body = anthropic_error_body(message, anthropic_error_type(openai_type))
    return event("error", body)


class MessageStream:
    """One streamed answer: feed OpenAI chunks in order, write what comes out."""

    def __init__(self, stop_sequences: Sequence[str] = ()) -> None:
        self.stop_sequences = tuple(stop_sequences)
        self.started = False
        self.ended = False
        self._block = -1  # index of the open content block; -1: none yet
        self._open: str | None = None  # "text", or the OpenAI index of a tool call
        self._pinged = False
        self._stop: tuple[str, str | None] | None = None
        self._usage: dict[str, int] | None = None

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events for one OpenAI chunk (``{"error": …}`` included)."""
        if self.ended:
            return b""
        if "error" in chunk:
            return self._error(chunk["error"])
        out = [] if self.started else [self._start(chunk)]
        if chunk.get("usage"):
            self._usage = usage_of(chunk["usage"])
        for choice in chunk.get("choices") or []:
            out.extend(self._choice(choice))
        if self._stop is not None and self._usage is not None:
            out.append(self._end())
        return b"".join(out)

    def done(self) -> bytes:
        """``data: [DONE]``: the end, even if no usage came."""
        if self.ended or not self.started or self._stop is None:
            return b""
        return self._end()

    def heartbeat(self) -> bytes:
        return b"" if self.ended else PING

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        message = {"id": message_id(str(chunk.get("id", ""))), "type": "message",
                   "role": "assistant", "model": chunk.get("model", ""), "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   # Known only at the end (message_delta): the worker counts them.
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return event("message_start", {"type": "message_start", "message": message})

    def _choice(self, choice: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text:
            if self._open != "text":
                out.extend(self._open_block({"type": "text", "text": ""}, "text"))
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            out.extend(self._tool_call(call))
        if choice.get("finish_reason"):
            self._stop = stop_of(choice, self.stop_sequences)
            out.extend(self._close_block())
        return out

    def _tool_call(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        key = f"tool:{call.get('index', 0)}"
        function = call.get("function") or {}
        if self._open != key:
            block = {"type": "tool_use", "id": tool_use_id(str(call.get("id", ""))),
                     "name": function.get("name", ""), "input": {}}
            out.extend(self._open_block(block, key))
        if function.get("arguments"):
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": function["arguments"]}))
        return out

    def _open_block(self, block: dict[str, Any], key: str) -> list[bytes]:
        out = self._close_block()
        self._block += 1
        self._open = key
        out.append(event("content_block_start", {"type": "content_block_start",
                                                 "index": self._block, "content_block": block}))
        if not self._pinged:
            self._pinged = True
            out.append(PING)
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta",
                                             "index": self._block, "delta": delta})

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self._block})]

    def _end(self) -> bytes:
        self.ended = True
        stop_reason, stop_sequence = self._stop or ("end_turn", None)
        used = self._usage or {"input_tokens": 0, "output_tokens": 0}
        return b"".join(self._close_block() + [
            event("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop_reason,
                                              "stop_sequence": stop_sequence},
                                    "usage": used}),
            event("message_stop", {"type": "message_stop"})])

    def _error(self, error: Any) -> bytes:
        self.ended = True
        error = error if isinstance(error, dict) else {}
        return error_event(str(error.get("message", "the generation failed")),
                           str(error.get("type", "upstream_error")))
