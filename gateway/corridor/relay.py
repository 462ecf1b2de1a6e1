"""Relaying a winning attempt to the client: SSE event by event, or one JSON body.

The gateway always asks workers for a stream (with usage), so retries, hedges
and timing work the same for every request; a client that asked for
``stream: false`` gets the events folded into one completion object. A
failure after the first token has reached the client ends the stream with an
SSE ``error`` event, never a silent truncation.
"""

from __future__ import annotations

import asyncio
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
    nothing for ``stall_s`` is cut (ClientStalled). Both limits are kept by one
    timer per reader (``ReaderPace``), not a cancel scope per wait and write.
    """
    with anyio.CancelScope() as scope:
        pace = ReaderPace(scope, heartbeat_s, stall_s)
        try:
            await _follow(request, stream, after, include_usage, pace, observer)
        finally:
            pace.stop()
    if pace.stalled:
        raise ClientStalled(f"the client accepted no bytes for {stall_s:.1f}s")
    await request.send({"type": "http.response.body", "body": b""})


async def _follow(request: Request, stream: StreamLog, after: int, include_usage: bool,
                  pace: ReaderPace, observer: RelayObserver | None) -> None:
    while True:
        try:
            events = stream.events_after(after)
        except ReaderOverrun as overrun:
            log.warning("slow reader on %s: %s", stream.request_id, overrun)
            await pace.write(request, _error_event(
                "the client read too slowly: the stream ran ahead of what the gateway keeps "
                f"({overrun}); resume with Last-Event-ID or retry", "slow_reader"))
            return
        if events:
            after = events[-1].id
            if len(events) == 1:
                body = events[0].payload if include_usage or events[0].kind != "usage" else b""
            else:
                body = b"".join(e.payload for e in events if include_usage or e.kind != "usage")
            if body:
                await pace.write(request, body)
            if observer is not None:
                written = time.monotonic()
                for event in events:
                    observer.relayed(event.received, written, event.kind == "token")
            continue
        if stream.finished:
            return
        if pace.heartbeat_due():
            await pace.write(request, HEARTBEAT)
            continue
        await pace.wait(stream)


class ReaderPace:
    """One reader's two limits on one timer, re-armed only when it fires: a
    heartbeat after ``heartbeat_s`` without a write, and the cut of a client
    that accepts nothing for ``stall_s`` (``scope`` cancelled, ``stalled`` set).
    A token relayed on time costs two clock reads, no timer and no scope."""

    def __init__(self, scope: anyio.CancelScope, heartbeat_s: float, stall_s: float) -> None:
        self.scope = scope
        self.heartbeat_s, self.stall_s = heartbeat_s, stall_s
        self.loop = asyncio.get_running_loop()
        self.last_write = self.loop.time()
        self.writing_since: float | None = None
        self.stalled = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = self.loop.call_at(
            self.last_write + min(heartbeat_s, stall_s), self._check)

    def heartbeat_due(self) -> bool:
        return self.loop.time() - self.last_write >= self.heartbeat_s

    async def wait(self, stream: StreamLog) -> None:
        """Until the stream changes or a heartbeat is due."""
        self.waiter = stream.next_change()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def write(self, request: Request, body: bytes) -> None:
        self.writing_since = self.loop.time()
        try:
            await request.send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            self.writing_since = None
            self.last_write = self.loop.time()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        now = self.loop.time()
        if self.writing_since is not None:
            due = self.writing_since + self.stall_s
            if now >= due:
                self.stalled = True
                self.timer = None
                self.scope.cancel()
                return
        else:
            due = self.last_write + self.heartbeat_s
            if now >= due:
                if self.waiter is not None and not self.waiter.done():
                    self.waiter.set_result(None)
                due = now + self.heartbeat_s
            # A write may start before the next check: never later than its stall limit.
            due = min(due, now + self.stall_s)
        self.timer = self.loop.call_at(due, self._check)


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
