"""Relaying a winning attempt to the client: SSE event by event, or one JSON body.

The gateway always asks workers for a stream (with usage), so retries, hedges
and timing work the same for every request; a client that asked for
``stream: false`` gets the events folded into one completion object. A
failure after the first token has reached the client ends the stream with an
SSE ``error`` event, never a silent truncation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import orjson

from gateway.corridor.stream_log import ReaderOverrun, StreamLog
from hedgerow import openai_api as oa
from hedgerow.asgi import Request, sse_event
from hedgerow.completion_fold import CompletionFold, FoldError
from hedgerow.errors import UpstreamFailed

log = logging.getLogger("hedgerow.gateway.relay")


@dataclass
class RelayOutcome:
    """What the relay saw: whether the worker finished cleanly, and usage."""

    complete: bool = False
    failed: bool = False
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = "stop"
    pieces: int = 0  # chunks that carried generated text
    # Only a non-streaming client (and the cache) needs the answer itself: every
    # choice's content, tool calls and logprobs, folded; a stream never keeps it.
    keep_text: bool = False
    fold: CompletionFold = field(default_factory=CompletionFold)
    # How it failed, when it did: what a non-streaming client's 502 says.
    error_message: str = ""
    error_code: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def observe_chunk(outcome: RelayOutcome, chunk: dict[str, Any]) -> bool:
    """Record one chunk; True when it is the usage-only chunk."""
    usage = chunk.get("usage")
    if usage:
        if not isinstance(usage, dict):
            raise UpstreamFailed("the worker sent a usage that is not an object",
                                 code="upstream_malformed")
        outcome.prompt_tokens = _token_count(usage, "prompt_tokens")
        outcome.completion_tokens = _token_count(usage, "completion_tokens")
    choices = chunk.get("choices") or []
    if not choices:
        return bool(usage)
    choice = choices[0] if isinstance(choices, list) else None
    if not isinstance(choice, dict):
        raise UpstreamFailed("the worker sent choices that are not a list of objects",
                             code="upstream_malformed")
    delta = choice.get("delta") or {}
    piece = (delta.get("content") if isinstance(delta, dict) else None) or choice.get("text") or ""
    finish = choice.get("finish_reason")
    if not isinstance(piece, str) or not isinstance(finish, str | None):
        raise UpstreamFailed("the worker sent a choice whose text or finish_reason is not a "
                             "string", code="upstream_malformed")
    if piece or (isinstance(delta, dict) and delta.get("tool_calls")):
        outcome.pieces += 1
    if outcome.keep_text:
        try:
            outcome.fold.feed(chunk)
        except FoldError as error:
            raise UpstreamFailed(f"the worker sent a malformed chunk: {error}",
                                 code="upstream_malformed") from None
    if finish:
        outcome.finish_reason = finish
    return False


MAX_TOKEN_COUNT = 2**31  # far above any context window; bounds what the ledgers add up


def _token_count(usage: dict[str, Any], name: str) -> int:
    """A worker's token count: a JSON integer (not a bool, float or string) in range."""
    value = usage.get(name, 0)
    if type(value) is not int or not 0 <= value < MAX_TOKEN_COUNT:
        raise UpstreamFailed(f"the worker sent {name}={str(value)[:40]!r}, not a token count",
                             code="upstream_malformed")
    return value


class RelayObserver(Protocol):
    """Told about each event written to a streaming client (monotonic seconds)."""

    def relayed(self, received: float, written: float, token: bool) -> None: ...


HEARTBEAT = b": keep-alive\n\n"


class ClientStalled(Exception):
    """The client accepted no bytes for longer than the policy allows."""


async def follow_log(
    request: Request, stream: StreamLog, *, after: int, include_usage: bool,
    heartbeat_s: float, stall_s: float, observer: RelayObserver | None = None,
) -> None:
    """Write the log's events above ``after`` to the client as they come, then end.

    The response must have started. Events waiting together go out in one
    write. An idle stream gets a comment every ``heartbeat_s``. A reader that
    fell behind what the log keeps gets an error event; one that accepts
    nothing for ``stall_s`` is cut (ClientStalled).
    """
    while True:
        try:
            events = stream.events_after(after)
        except ReaderOverrun as overrun:
            log.warning("slow reader on %s: %s", stream.request_id, overrun)
            await _write(request, _error_event(
                "the client read too slowly: the stream ran ahead of what the gateway keeps "
                f"({overrun}); resume with Last-Event-ID or retry", "slow_reader"), stall_s)
            break
        if events:
            after = events[-1].id
            body = b"".join(e.payload for e in events
                            if include_usage or e.kind != "usage")
            if body:
                await _write(request, body, stall_s)
            if observer is not None:
                written = time.monotonic()
                for event in events:
                    observer.relayed(event.received, written, event.kind == "token")
            continue
        if stream.finished:
            break
        if not await stream.wait_beyond(after, heartbeat_s):
            await _write(request, HEARTBEAT, stall_s)
    await request.send({"type": "http.response.body", "body": b""})


async def _write(request: Request, body: bytes, stall_s: float) -> None:
    with anyio.move_on_after(stall_s) as waited:
        await request.send({"type": "http.response.body", "body": body, "more_body": True})
    if waited.cancelled_caught:
        raise ClientStalled(f"the client accepted no bytes for {stall_s:.1f}s")


def _error_event(message: str, code: str) -> bytes:
    return sse_event(oa.error_event(message, UpstreamFailed.error_type, code))


def completion_body(request_id: str, model: str, outcome: RelayOutcome, chat: bool) -> bytes:
    """The whole answer a non-streaming client gets: every choice as it streamed."""
    used = oa.usage(outcome.prompt_tokens, outcome.completion_tokens)
    if chat:
        return orjson.dumps(oa.chat_completion_of(
            request_id, model, oa.now_created(),
            outcome.fold.chat_choices(outcome.finish_reason), used))
    return orjson.dumps(oa.text_completion_of(request_id, model, oa.now_created(),
                                              outcome.fold.text_choices(outcome.finish_reason),
                                              used))
