"""What the request corridor carries and computes per request: plain data and
pure functions (deadlines, estimates, headers, the upstream body), and how a
request the drain cut is ended.

``Asked`` is a validated completion request (enough to answer it from the
cache); ``Wanted`` one that missed, ready to schedule; ``Caching`` its cache
keys, computed once and carried to the lookup, the flight and the store;
``Flight`` one generation shared by identical requests (single-flight).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.corridor.attempt import UpstreamCall
from gateway.cache.keys import CacheKeys
from gateway.corridor.drain import InFlight
from gateway.admin.metrics import RequestMetrics
from gateway.corridor.relay import RelayOutcome
from gateway.corridor.stream_log import StreamLog
from gateway.corridor.tickets import Ticket
from hedgerow import openai_api as oa
from hedgerow.asgi import Headers, Request, sse_event
from hedgerow.decimal_text import MAX_DIGITS, parse_decimal
from hedgerow.errors import GatewayDraining, InvalidRequest, UnsupportedMediaType
from policies.affinity import conversation_key
from policies.schema import Policy, PriorityClass


# A joiner's answer is complete when the shared stream is; the leader's usage
# follows at once, but a log line is never held back longer than this for it.
JOIN_USAGE_WAIT_S = 1.0


def note_usage(observed: RequestMetrics, outcome: RelayOutcome | None,
                cached: str = "") -> None:
    """The tokens the worker reported for a generation (none: it never started)."""
    if outcome is not None and (outcome.prompt_tokens or outcome.completion_tokens):
        observed.used(outcome.prompt_tokens, outcome.completion_tokens, cached=cached,
                      error_code=outcome.error_code)
    elif outcome is not None and outcome.error_code:
        observed.error_code = observed.error_code or outcome.error_code


@dataclass(frozen=True)
class Asked:
    """One validated completion request: enough to answer it from the cache."""

    request_id: str
    tenant: str
    model: str  # canonical
    policy: Policy  # the one in force when it arrived
    parsed: oa.ChatCompletionRequest | oa.CompletionRequest
    observed: RequestMetrics


@dataclass(frozen=True)
class Wanted:
    """One completion request that missed the cache, ready to schedule."""

    ticket: Ticket
    call: UpstreamCall
    parsed: oa.ChatCompletionRequest | oa.CompletionRequest
    chat: bool
    observed: RequestMetrics


@dataclass(frozen=True)
class Caching:
    """A cacheable request that missed: its exact key, for sharing and storing."""

    key: str
    keys: CacheKeys
    request_json: dict[str, Any]
    headers: Headers
    share: bool  # identical requests arriving meanwhile may join its generation


@dataclass(eq=False)
class Flight:
    """One generation, shared by identical requests (single-flight)."""

    stream: StreamLog
    outcome: RelayOutcome | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def joinable(self) -> bool:
        """Joining replays it from its first event, so all of them must still be kept."""
        return not self.done.is_set() and self.stream.holds_after(0)


def answer_headers(request_id: str, worker_id: str | None, cache: bytes,
                    hedged: bool) -> Headers:
    headers: Headers = [(b"x-request-id", request_id.encode()), (b"x-hedgerow-cache", cache),
                        (b"x-hedgerow-hedged", b"1" if hedged else b"0")]
    if worker_id:
        headers.append((b"x-hedgerow-worker", worker_id.encode()))
    return headers


DEFAULT_OUTPUT_ESTIMATE = 256


CHARS_PER_TOKEN = 4


def tokens_in(text: str) -> int:
    """About four characters a token, at least one: an estimate to admit and route
    by where no tokenizer is at hand (the answer's usage settles the real count)."""
    return max(1, len(text) // CHARS_PER_TOKEN)


def estimate_prompt_tokens(parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> int:
    """``tokens_in`` the prompt (each chat message's text plus ~2 tokens of framing)."""
    if isinstance(parsed, oa.ChatCompletionRequest):
        chars = sum(len(m.text()) + 8 for m in parsed.messages)
    else:
        chars = len(parsed.prompt)
    return max(1, chars // CHARS_PER_TOKEN)


def prefix_key(model: str, parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> str | None:
    """The conversation's key for prompt-cache affinity: the same for every turn,
    so each next turn goes to the worker holding the conversation's KV cache."""
    if not isinstance(parsed, oa.ChatCompletionRequest):
        return None
    return conversation_key(model, [(m.role, m.text()) for m in parsed.messages])


def deadlines(klass: PriorityClass, header: str | None) -> tuple[int, int]:
    """The request's deadline and first-token due time (ms from arrival).

    Served in order of first-token due time: the class's SLO, or sooner when
    the client asked for a tighter deadline than that.
    """
    deadline_ms = _tighter_deadline(klass.deadline_ms, header)
    due_ms = klass.ttft_slo_ms if header is None else min(klass.ttft_slo_ms, deadline_ms)
    return deadline_ms, due_ms


def _tighter_deadline(class_deadline_ms: int, header: str | None) -> int:
    if header is None:
        return class_deadline_ms
    deadline_ms = parse_decimal(header.strip(" \t"))
    if deadline_ms is None or deadline_ms < 1:
        raise InvalidRequest(f"x-hedgerow-deadline-ms must be a positive integer of at most "
                             f"{MAX_DIGITS} ASCII digits", param="x-hedgerow-deadline-ms")
    return min(class_deadline_ms, deadline_ms)


def last_event_id(request: Request) -> int:
    """The resume point: ``Last-Event-ID`` (as EventSource sends it) or
    ``?last_event_id=``; none means from the first event."""
    raw = request.header("last-event-id")
    if raw is None:
        raw = request.query().get("last_event_id")
    if raw is None or raw.strip(" \t") == "":
        return 0
    event_id = parse_decimal(raw.strip(" \t"))
    if event_id is None:
        raise InvalidRequest("Last-Event-ID must be a non-negative integer event id of at "
                             f"most {MAX_DIGITS} ASCII digits", param="Last-Event-ID")
    return event_id


def upstream_body(request_json: dict[str, Any], model: str) -> bytes:
    """Workers are always asked to stream, with usage, for the canonical model name.
    (A copy: ``request_json`` is also the cache's key material.)"""
    return orjson.dumps({**request_json, "model": model, "stream": True,
                         "stream_options": {"include_usage": True}})


def require_json(request: Request) -> None:
    content_type = (request.header("content-type") or "application/json").lower()
    if "json" not in content_type:
        raise UnsupportedMediaType(f"content-type must be application/json, not {content_type!r}")


def drain_cut_error() -> GatewayDraining:
    return GatewayDraining("the gateway shut down before the response was complete",
                           retry_after=1)


def end_with_draining(stream: StreamLog, in_flight: InFlight) -> None:
    """If the drain deadline cuts this request, ``stream`` ends with
    ``gateway_draining``: set before anything is cancelled, so whichever ends
    first -- the generation writing the stream's last event, or
    ``end_cut_request`` -- the client reads the same error."""
    def note() -> None:
        draining = drain_cut_error()
        stream.cancel(draining.message, code=draining.code, error_type=draining.error_type)

    in_flight.before_cut.append(note)


async def end_cut_request(request: Request, in_flight: InFlight) -> None:
    """The drain deadline cut this request: end it explicitly, never silently."""
    draining = drain_cut_error()
    if not in_flight.response_started:
        raise draining
    if in_flight.response_finished:
        return
    event = oa.error_event(draining.message, draining.error_type, draining.code)
    await request.send({"type": "http.response.body", "body": sse_event(event),
                        "more_body": True})
    await request.send({"type": "http.response.body", "body": b""})
