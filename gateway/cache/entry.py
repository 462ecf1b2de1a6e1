"""A cached answer, its compact encoding, and its replay as a live response.

An entry keeps what a client sees of a completion, not how it was produced:
text, finish reason, usage, model and creation time. ``sse_replay`` produces
the same event sequence a worker streams (role chunk, content chunks, finish
chunk, the usage chunk when ``stream_options.include_usage``, ``[DONE]``),
so an SSE client cannot tell a hit from a live answer except by speed and
the ``x-hedgerow-cache`` header. Text is cut into runs of a few words so the
client still sees a stream.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from hedgerow import openai_api as oa
from hedgerow.asgi import SSE_DONE, sse_event

WORDS_PER_CHUNK = 4
MAX_TEXT_CHARS = 1_000_000

_PIECE = re.compile(r"\s*\S+")


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

    def encode(self) -> bytes:
        """Compact orjson: a short array, no field names."""
        return orjson.dumps([1, self.text, self.finish_reason, self.prompt_tokens,
                             self.completion_tokens, self.model, self.created, int(self.chat)])

    @classmethod
    def decode(cls, data: bytes) -> CacheEntry:
        try:
            version, text, finish, prompt, completion, model, created, chat = orjson.loads(data)
        except (orjson.JSONDecodeError, ValueError, TypeError) as error:
            raise EntryDecodeError(f"not a cache entry: {error}") from None
        if version != 1 or not isinstance(text, str):
            raise EntryDecodeError(f"unknown cache entry version {version!r}")
        return cls(text, str(finish), int(prompt), int(completion), str(model), int(created),
                   bool(chat))

    @property
    def size(self) -> int:
        """Approximate bytes held: what the encoding takes."""
        return len(self.text.encode()) + len(self.model) + 64

    def usage(self) -> dict[str, int]:
        return oa.usage(self.prompt_tokens, self.completion_tokens)


def entry_from_response(body: dict[str, Any]) -> CacheEntry | None:
    """The entry for a finished non-streaming response body (chat or text); None
    if it is not a single, complete, plain-text answer worth caching."""
    choices = body.get("choices")
    used = body.get("usage") or {}
    if not isinstance(choices, list) or len(choices) != 1:
        return None
    choice = choices[0]
    chat = body.get("object") == "chat.completion"
    message = choice.get("message") or {}
    text = message.get("content") if chat else choice.get("text")
    if not isinstance(text, str) or message.get("tool_calls") or len(text) > MAX_TEXT_CHARS:
        return None
    return CacheEntry(text, str(choice.get("finish_reason") or "stop"),
                      int(used.get("prompt_tokens", 0)), int(used.get("completion_tokens", 0)),
                      str(body.get("model", "")), int(body.get("created") or oa.now_created()),
                      chat)


class EntryBuilder:
    """Collects a relayed stream's chunks into an entry (bounded by MAX_TEXT_CHARS).

    Feed each decoded ``data:`` payload (chat or text completion chunk); after
    the finish chunk (and the usage chunk, if any) ``build()`` gives the entry,
    or None if the stream did not finish, was too long, or carried tool calls.
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._chars = 0
        self._finish: str | None = None
        self._usage: dict[str, Any] = {}
        self._model = ""
        self._created = 0
        self._chat = True
        self._spoiled = False

    def feed(self, chunk: dict[str, Any]) -> None:
        self._model = str(chunk.get("model") or self._model)
        self._created = int(chunk.get("created") or self._created)
        self._chat = chunk.get("object") != "text_completion"
        self._usage = chunk.get("usage") or self._usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("tool_calls") or choice.get("index", 0) != 0:
                self._spoiled = True
            text = delta.get("content") if self._chat else choice.get("text")
            if isinstance(text, str) and text:
                self._parts.append(text)
                self._chars += len(text)
                self._spoiled = self._spoiled or self._chars > MAX_TEXT_CHARS
            self._finish = choice.get("finish_reason") or self._finish

    def build(self) -> CacheEntry | None:
        if self._spoiled or self._finish is None:
            return None
        return CacheEntry("".join(self._parts), self._finish,
                          int(self._usage.get("prompt_tokens", 0)),
                          int(self._usage.get("completion_tokens", 0)), self._model,
                          self._created or oa.now_created(), self._chat)


def text_pieces(text: str, words: int = WORDS_PER_CHUNK) -> Iterator[str]:
    """``text`` in runs of ``words`` words; joined back they are ``text`` exactly."""
    matches = _PIECE.findall(text)
    consumed = sum(len(m) for m in matches)
    for start in range(0, len(matches), words):
        yield "".join(matches[start:start + words])
    if consumed < len(text):  # trailing whitespace
        yield text[consumed:]


def sse_replay(
    entry: CacheEntry, request_id: str, *, model: str | None = None,
    created: int | None = None, include_usage: bool = False,
) -> Iterator[bytes]:
    """The SSE events of a live stream for this answer, ``data: [DONE]`` last.

    ``model`` is the name the client asked for (default: the cached one);
    ``created`` defaults to now, as a fresh answer would have.
    """
    name = model or entry.model
    when = oa.now_created() if created is None else created
    if entry.chat:
        role = {"role": "assistant", "content": ""}
        yield sse_event(oa.chat_chunk(request_id, name, when, role))
        for piece in text_pieces(entry.text):
            yield sse_event(oa.chat_chunk(request_id, name, when, {"content": piece}))
        yield sse_event(oa.chat_chunk(request_id, name, when, {}, entry.finish_reason))
    else:
        for piece in text_pieces(entry.text):
            yield sse_event(oa.text_chunk(request_id, name, when, piece))
        yield sse_event(oa.text_chunk(request_id, name, when, "", entry.finish_reason))
    if include_usage:
        yield sse_event(oa.usage_chunk(request_id, name, when, entry.usage()))
    yield SSE_DONE


def json_replay(
    entry: CacheEntry, request_id: str, *, model: str | None = None, created: int | None = None,
) -> dict[str, Any]:
    """The non-streaming response body for this answer."""
    name = model or entry.model
    when = oa.now_created() if created is None else created
    build = oa.chat_completion if entry.chat else oa.text_completion
    return build(request_id, name, when, entry.text, entry.finish_reason, entry.usage())
