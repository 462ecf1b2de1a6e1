"""Streamed completion chunks folded into the whole answer, and back (sans-IO).

OpenAI's SDKs rebuild a streamed answer the same way: per choice ``index``,
content pieces are concatenated, each tool call (by its own ``index``) takes
its ``id``, ``type`` and ``function.name`` from the first delta that names
them and concatenates ``function.arguments``, logprob entries are appended,
and the last ``finish_reason`` wins. ``CompletionFold`` does exactly that, so
a non-streaming client (the gateway always streams from workers), the cache
and a worker's own non-streamed answer all see every field a live stream
carried, never just its text.

``replay_deltas`` goes the other way, for a cached answer: the deltas a live
stream of that choice would carry (role, content in pieces with their
logprobs, tool-call header then arguments, finish), which an SDK folds back
into the same message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_PIECE = re.compile(r"\s*\S+")
WORDS_PER_CHUNK = 4


class FoldError(ValueError):
    """A chunk whose shape no OpenAI stream has (the caller maps it to its own error)."""


_FOLDED_DELTA = frozenset({"role", "content", "tool_calls"})
_FOLDED_CHOICE = frozenset({"index", "delta", "text", "logprobs", "finish_reason"})


@dataclass
class ToolCallFold:
    id: str = ""
    type: str = "function"
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def whole(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.name, "arguments": "".join(self.arguments)}}


@dataclass
class ChoiceFold:
    index: int
    content: list[str] = field(default_factory=list)
    saw_content: bool = False  # a content delta (even "") or text arrived
    tool_calls: dict[int, ToolCallFold] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    # Other text an upstream streams (vLLM's reasoning_content, a refusal), kept
    # for the whole message; and whether anything arrived that the fold could
    # not keep. Either way the cache could not replay this choice exactly.
    extra: dict[str, list[str]] = field(default_factory=dict)
    unknown: bool = False

    @property
    def text(self) -> str:
        return "".join(self.content)

    def message(self) -> dict[str, Any]:
        """The chat ``message`` of this choice: content null when it is only tool calls."""
        calls = [self.tool_calls[i].whole() for i in sorted(self.tool_calls)]
        content: str | None = self.text
        if calls and not content:
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        for name, parts in self.extra.items():
            message[name] = "".join(parts)
        if calls:
            message["tool_calls"] = calls
        return message

    def chat_logprobs(self) -> dict[str, Any] | None:
        return None if self.logprobs is None else {"content": self.logprobs, "refusal": None}


class CompletionFold:
    """Feed each decoded chunk (chat or text completion) in order; read ``choices``."""

    def __init__(self) -> None:
        self._choices: dict[int, ChoiceFold] = {}
        self.chat = True

    def feed(self, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices") or ()
        if choices:  # a usage-only chunk may be labelled either way
            self.chat = chunk.get("object") != "text_completion"
        for choice in choices:
            if not isinstance(choice, dict):
                raise FoldError("a choice is not an object")
            self._feed_choice(choice)

    def _feed_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        if type(index) is not int or not 0 <= index < 128:
            raise FoldError(f"a choice index {str(index)[:16]!r} is not a small integer")
        fold = self._choices.get(index) or self._choices.setdefault(index, ChoiceFold(index))
        delta = choice.get("delta") if self.chat else {"content": choice.get("text")}
        if not isinstance(delta, dict):
            raise FoldError("a delta is not an object")
        content = delta.get("content")
        if isinstance(content, str):
            fold.saw_content = True
            fold.content.append(content)
        for call in delta.get("tool_calls") or ():
            _fold_tool_call(fold, call)
        for name, value in delta.items():
            if name in _FOLDED_DELTA or value is None:
                continue
            if isinstance(value, str):
                fold.extra.setdefault(name, []).append(value)
            else:
                fold.unknown = True
        fold.unknown = fold.unknown or any(
            value is not None for name, value in choice.items() if name not in _FOLDED_CHOICE)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            fold.logprobs = (fold.logprobs or []) + logprobs["content"]
        if choice.get("finish_reason"):
            fold.finish_reason = str(choice["finish_reason"])

    @property
    def choices(self) -> list[ChoiceFold]:
        return [self._choices[i] for i in sorted(self._choices)]

    def first(self) -> ChoiceFold:
        """Choice 0 (empty before any arrived)."""
        return self.choices[0] if self._choices else ChoiceFold(0)

    def chat_choices(self, default_finish: str = "stop") -> list[dict[str, Any]]:
        return [{"index": c.index, "message": c.message(), "logprobs": c.chat_logprobs(),
                 "finish_reason": c.finish_reason or default_finish} for c in self.choices]

    def text_choices(self, default_finish: str = "stop") -> list[dict[str, Any]]:
        return [{"index": c.index, "text": c.text, "logprobs": None,
                 "finish_reason": c.finish_reason or default_finish}
                for c in self.choices or [ChoiceFold(0)]]


def _fold_tool_call(fold: ChoiceFold, call: Any) -> None:
    if not isinstance(call, dict) or type(call.get("index", 0)) is not int:
        raise FoldError("a tool call delta is not an object with an integer index")
    target = fold.tool_calls.setdefault(call.get("index", 0), ToolCallFold())
    function = call.get("function") or {}
    if not isinstance(function, dict):
        raise FoldError("a tool call's function is not an object")
    if call.get("id"):
        target.id = str(call["id"])
    if call.get("type"):
        target.type = str(call["type"])
    if function.get("name"):
        target.name = str(function["name"])
    if isinstance(function.get("arguments"), str):
        target.arguments.append(function["arguments"])


def text_pieces(text: str, words: int = WORDS_PER_CHUNK) -> Iterator[str]:
    """``text`` in runs of ``words`` words; joined back they are ``text`` exactly."""
    matches = _PIECE.findall(text)
    consumed = sum(len(m) for m in matches)
    for start in range(0, len(matches), words):
        yield "".join(matches[start:start + words])
    if consumed < len(text):  # trailing whitespace
        yield text[consumed:]


def replay_deltas(
    content: str | None, tool_calls: list[dict[str, Any]], logprobs: list[dict[str, Any]] | None,
) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(delta, logprobs) pairs a live stream of this choice carries, after its role chunk.

    With logprobs, content goes one token a chunk (each with its entry), as a
    worker streams it; the caller stores such an answer only when its tokens
    join into its content (``replayable``).
    """
    if logprobs:
        for entry in logprobs:
            yield {"content": entry.get("token", "")}, {"content": [entry], "refusal": None}
    elif content:
        for piece in text_pieces(content):
            yield {"content": piece}, None
    for index, call in enumerate(tool_calls):
        function = call.get("function") or {}
        yield {"tool_calls": [{"index": index, "id": call.get("id"), "type": "function",
                               "function": {"name": function.get("name"), "arguments": ""}}]}, None
        if function.get("arguments"):
            yield {"tool_calls": [{"index": index,
                                   "function": {"arguments": function["arguments"]}}]}, None


def replayable(choice: ChoiceFold) -> bool:
    """Whether ``replay_deltas`` gives back this choice exactly."""
    calls_whole = all(c.id and c.name for c in choice.tool_calls.values())
    if choice.extra or choice.unknown:
        return False
    if choice.logprobs is None:
        return calls_whole
    tokens = "".join(str(e.get("token", "")) for e in choice.logprobs)
    return calls_whole and tokens == choice.text
