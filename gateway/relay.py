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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from gateway.attempt import Attempt
from hedgerow import openai_api as oa
from hedgerow.asgi import SSE_HEADERS, Headers, Request, sse_event
from hedgerow.errors import UpstreamFailed
from hedgerow.sse import SseEvent

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
    # Only a non-streaming client needs the text itself; a stream never keeps it.
    keep_text: bool = False
    text: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _observe(outcome: RelayOutcome, chunk: dict[str, Any]) -> bool:
    """Record one chunk; True when it is the usage-only chunk."""
    usage = chunk.get("usage")
    if usage:
        outcome.prompt_tokens = int(usage.get("prompt_tokens", 0))
        outcome.completion_tokens = int(usage.get("completion_tokens", 0))
    choices = chunk.get("choices") or []
    if not choices:
        return bool(usage)
    choice = choices[0]
    piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    if piece:
        outcome.pieces += 1
        if outcome.keep_text:
            outcome.text.append(piece)
    if choice.get("finish_reason"):
        outcome.finish_reason = choice["finish_reason"]
    return False


class RelayObserver(Protocol):
    """Told about each event written to a streaming client (monotonic seconds)."""

    def relayed(self, received: float, written: float, token: bool) -> None: ...


async def _all_events(attempt: Attempt) -> AsyncIterator[SseEvent]:
    for event in attempt.first:
        yield event
    async for event in attempt.events:
        yield event


async def stream_to_client(
    request: Request, attempt: Attempt, headers: Headers, include_usage: bool,
    observer: RelayObserver | None = None,
) -> RelayOutcome:
    """Relay the attempt's events as they come; ``observer`` hears when each was written.

    An event's ``received`` time is when the relay got it from the upstream
    parser; for the events read while getting the first token, the moment
    that first token arrived.
    """
    outcome = RelayOutcome()
    await request.send({"type": "http.response.start", "status": 200,
                        "headers": list(SSE_HEADERS) + headers})
    try:
        for event in attempt.first:
            await _relay(request, event, outcome, include_usage, observer,
                         attempt.first_token_at)
        async for event in attempt.events:
            await _relay(request, event, outcome, include_usage, observer, time.monotonic())
    except UpstreamFailed as error:
        outcome.failed = True
        log.warning("request stream from %s failed mid-way: %s", attempt.worker_id, error)
        await _send_error_event(request, error.message, error.code)
    if not outcome.complete and not outcome.failed:
        outcome.failed = True
        await _send_error_event(
            request, f"worker {attempt.worker_id} ended the stream before it was complete",
            "upstream_truncated")
    await request.send({"type": "http.response.body", "body": b""})
    return outcome


async def _relay(request: Request, event: SseEvent, outcome: RelayOutcome,
                 include_usage: bool, observer: RelayObserver | None, received: float) -> None:
    pieces = outcome.pieces
    if event.data == "[DONE]":
        outcome.complete = True
    elif _relay_skips(outcome, event, include_usage):
        return
    await request.send({"type": "http.response.body", "body": event.raw, "more_body": True})
    if observer is not None:
        observer.relayed(received, time.monotonic(), outcome.pieces > pieces)


def _relay_skips(outcome: RelayOutcome, event: SseEvent, include_usage: bool) -> bool:
    try:
        chunk = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return False
    if "error" in chunk:
        outcome.failed = True
        return False
    usage_only = _observe(outcome, chunk)
    return usage_only and not include_usage


async def _send_error_event(request: Request, message: str, code: str) -> None:
    event = sse_event(oa.error_event(message, UpstreamFailed.error_type, code))
    await request.send({"type": "http.response.body", "body": event, "more_body": True})


async def collect(attempt: Attempt) -> RelayOutcome:
    """Read the whole stream for a non-streaming client."""
    outcome = RelayOutcome(keep_text=True)
    async for event in _all_events(attempt):
        if event.data == "[DONE]":
            outcome.complete = True
            continue
        try:
            chunk = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            raise UpstreamFailed(f"worker {attempt.worker_id} sent an event that is not JSON",
                                 code="upstream_malformed") from None
        if "error" in chunk:
            raise UpstreamFailed(str(chunk["error"].get("message", "worker error")),
                                 code="upstream_error")
        _observe(outcome, chunk)
    if not outcome.complete:
        raise UpstreamFailed(f"worker {attempt.worker_id} ended the stream early",
                             code="upstream_truncated")
    return outcome


def completion_body(request_id: str, model: str, outcome: RelayOutcome, chat: bool) -> bytes:
    used = oa.usage(outcome.prompt_tokens, outcome.completion_tokens)
    build = oa.chat_completion if chat else oa.text_completion
    return orjson.dumps(build(request_id, model, oa.now_created(), "".join(outcome.text),
                              outcome.finish_reason, used))
