"""A cached answer, its compact encoding, and its replay as a live response.

An entry keeps what a client sees of a completion, not how it was produced:
text, tool calls, logprobs, finish reason, usage, model and creation time.
``sse_replay`` produces the same event sequence a worker streams (role chunk,
content chunks -- one token a chunk with its logprobs when it has them --,
a tool call's header and arguments, finish chunk, the usage chunk when
``stream_options.include_usage``, ``[DONE]``), so an SSE client cannot tell a
hit from a live answer except by speed, call ids and the
``x-hedgerow-cache`` header. Without logprobs, text is cut into runs of a
few words so the client still sees a stream. An answer that could not be
replayed exactly (several choices, a tool call without its id or name,
logprob tokens that do not spell its text) is never made into an entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from hedgerow import openai_api as oa
from hedgerow.asgi import SSE_DONE, sse_event
from hedgerow.completion_fold import (
    CompletionFold,
    FoldError,
    replay_deltas,
    replayable,
    text_pieces,
)

MAX_TEXT_CHARS = 1_000_000
ENTRY_VERSION = 2  # 1: no tool calls, no logprobs (still read)


class EntryDecodeError(ValueError):
    """Stored bytes that are not an entry (another version, or corrupted)."""


@dataclass(frozen=True)
class CacheEntry:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    created: int
    chat: bool = True
    # A chat answer's tool calls (OpenAI's whole form: id, type, function) and
    # its logprob entries (None when the request asked for none).
    tool_calls: tuple[dict[str, Any], ...] = ()
    logprobs: tuple[dict[str, Any], ...] | None = None

    def encode(self) -> bytes:
        """Compact orjson: a short array, no field names. A plain-text answer keeps
        version 1's form, which gateways that predate tool calls still read."""
        fields: list[Any] = [1, self.text, self.finish_reason, self.prompt_tokens,
                             self.completion_tokens, self.model, self.created, int(self.chat)]
        if self.tool_calls or self.logprobs is not None:
            fields[0] = ENTRY_VERSION
            fields += [list(self.tool_calls),
                       None if self.logprobs is None else list(self.logprobs)]
        return orjson.dumps(fields)

    @classmethod
    def decode(cls, data: bytes) -> CacheEntry:
        try:
            fields = orjson.loads(data)
            version = fields[0] if isinstance(fields, list) and fields else None
            if version == 1:
                fields = [*fields, [], None]
            (_, text, finish, prompt, completion, model, created, chat, calls,
             logprobs) = fields
        except (orjson.JSONDecodeError, ValueError, TypeError) as error:
            raise EntryDecodeError(f"not a cache entry: {error}") from None
        if version not in (1, ENTRY_VERSION) or not isinstance(text, str):
            raise EntryDecodeError(f"unknown cache entry version {version!r}")
        if not isinstance(calls, list) or not isinstance(logprobs, list | None):
            raise EntryDecodeError("a cache entry's tool calls or logprobs are not lists")
        return cls(text, str(finish), int(prompt), int(completion), str(model), int(created),
                   bool(chat), tuple(calls), None if logprobs is None else tuple(logprobs))

    @property
    def size(self) -> int:
        """Approximate bytes held: what the encoding takes."""
        extra = 0
        if self.tool_calls or self.logprobs:
            extra = len(orjson.dumps([self.tool_calls, self.logprobs]))
        return len(self.text.encode()) + len(self.model) + 64 + extra

    def message(self) -> dict[str, Any]:
        """The chat message: content null when the answer is only tool calls."""
        content: str | None = None if self.tool_calls and not self.text else self.text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        return message

    def usage(self) -> dict[str, int]:
        return oa.usage(self.prompt_tokens, self.completion_tokens)


def entry_from_fold(fold: CompletionFold, finish_reason: str, prompt_tokens: int,
                    completion_tokens: int, model: str, created: int) -> CacheEntry | None:
    """The entry for a folded answer; None if it cannot be replayed exactly
    (not one choice, too long, a tool call or logprobs it could not give back)."""
    choices = fold.choices
    if len(choices) != 1 or choices[0].index != 0 or not replayable(choices[0]):
        return None
    choice = choices[0]
    if len(choice.text) > MAX_TEXT_CHARS or (choice.tool_calls and not fold.chat):
        return None
    calls = tuple(choice.tool_calls[i].whole() for i in sorted(choice.tool_calls))
    logprobs = None if choice.logprobs is None else tuple(choice.logprobs)
    return CacheEntry(choice.text, choice.finish_reason or finish_reason, prompt_tokens,
                      completion_tokens, model, created, fold.chat, calls, logprobs)


def entry_from_response(body: dict[str, Any]) -> CacheEntry | None:
    """The entry for a finished non-streaming response body (chat or text); None
    if it is not a single, complete answer that can be replayed exactly."""
    choices = body.get("choices")
    used = body.get("usage") or {}
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice, chat = choices[0], body.get("object") == "chat.completion"
    message = choice.get("message") or {}
    content = message.get("content") if chat else choice.get("text")
    calls = message.get("tool_calls") or []
    if not (isinstance(content, str) or (content is None and calls)):
        return None
    # As the stream that carried it: its content, then each call whole.
    delta: dict[str, Any] = {"content": content}
    if calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)
                               if isinstance(call, dict)]
    fold = CompletionFold()
    try:
        fold.feed({"object": "chat.completion.chunk" if chat else "text_completion",
                   "choices": [{"index": 0, "delta": delta, "text": content,
                                "logprobs": choice.get("logprobs"),
                                "finish_reason": choice.get("finish_reason")}]})
    except FoldError:
        return None
    return entry_from_fold(fold, str(choice.get("finish_reason") or "stop"),
                           int(used.get("prompt_tokens", 0)),
                           int(used.get("completion_tokens", 0)), str(body.get("model", "")),
                           int(body.get("created") or oa.now_created()))


class EntryBuilder:
    """Collects a relayed stream's chunks into an entry.

    Feed each decoded ``data:`` payload (chat or text completion chunk); after
    the finish chunk (and the usage chunk, if any) ``build()`` gives the entry,
    or None if the stream did not finish or could not be replayed exactly.
    """

    def __init__(self) -> None:
        self._fold = CompletionFold()
        self._usage: dict[str, Any] = {}
        self._model = ""
        self._created = 0
        self._spoiled = False

    def feed(self, chunk: dict[str, Any]) -> None:
        self._model = str(chunk.get("model") or self._model)
        self._created = int(chunk.get("created") or self._created)
        self._usage = chunk.get("usage") or self._usage
        try:
            self._fold.feed(chunk)
        except FoldError:
            self._spoiled = True

    def build(self) -> CacheEntry | None:
        if self._spoiled or self._fold.first().finish_reason is None:
            return None
        return entry_from_fold(self._fold, "stop", int(self._usage.get("prompt_tokens", 0)),
                               int(self._usage.get("completion_tokens", 0)), self._model,
                               self._created or oa.now_created())


def sse_replay(
    entry: CacheEntry, request_id: str, *, model: str | None = None,
    created: int | None = None, include_usage: bool = False,
) -> Iterator[bytes]:
    """The SSE events of a live stream for this answer, ``data: [DONE]`` last.

    ``model`` is the name the client asked for (default: the cached one);
    ``created`` defaults to now, as a fresh answer would have.
    """
    for _, event in replay_events(entry, request_id, model=model, created=created,
                                  include_usage=include_usage):
        yield event


# What each replayed event is, in ``gateway.corridor.stream_log.EventKind``'s words:
# the kinds the relay gives a live worker's events (``gateway.corridor.generation.classify``).
ReplayKind = Literal["token", "usage", "done", "other"]


def replay_events(
    entry: CacheEntry, request_id: str, *, model: str | None = None,
    created: int | None = None, include_usage: bool = False,
) -> Iterator[tuple[ReplayKind, bytes]]:
    """``sse_replay``'s events with their kinds, so a hit goes straight into a
    stream log without being parsed back from SSE."""
    name = model or entry.model
    when = oa.now_created() if created is None else created
    if entry.chat:
        role = {"role": "assistant", "content": ""}
        yield "other", sse_event(oa.chat_chunk(request_id, name, when, role))
        logprobs = None if entry.logprobs is None else list(entry.logprobs)
        for delta, shown in replay_deltas(entry.text, list(entry.tool_calls), logprobs):
            kind: ReplayKind = ("token" if delta.get("content") or delta.get("tool_calls")
                                else "other")
            yield kind, sse_event(oa.chat_chunk(request_id, name, when, delta, None, shown))
        yield "other", sse_event(oa.chat_chunk(request_id, name, when, {}, entry.finish_reason))
    else:
        for piece in text_pieces(entry.text):
            yield ("token" if piece else "other"), sse_event(
                oa.text_chunk(request_id, name, when, piece))
        yield "other", sse_event(oa.text_chunk(request_id, name, when, "", entry.finish_reason))
    if include_usage:
        yield "usage", sse_event(oa.usage_chunk(request_id, name, when, entry.usage()))
    yield "done", SSE_DONE


def json_replay(
    entry: CacheEntry, request_id: str, *, model: str | None = None, created: int | None = None,
) -> dict[str, Any]:
    """The non-streaming response body for this answer."""
    name = model or entry.model
    when = oa.now_created() if created is None else created
    if not entry.chat:
        return oa.text_completion(request_id, name, when, entry.text, entry.finish_reason,
                                  entry.usage())
    logprobs = None if entry.logprobs is None else {"content": list(entry.logprobs),
                                                    "refusal": None}
    choice = {"index": 0, "message": entry.message(), "logprobs": logprobs,
              "finish_reason": entry.finish_reason}
    return oa.chat_completion_of(request_id, name, when, [choice], entry.usage())
