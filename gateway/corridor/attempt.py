"""One attempt of a request on one worker, up to its first token.

``start_attempt`` opens the worker's stream and reads SSE events until the
first one that carries output (a token, or the finish); only then is the
attempt worth relaying. Everything before that point can still be retried or
raced by a hedge without the client noticing. A worker's 400, 413 or 422
(``UpstreamRejected``: the client's own mistake) is not retried, nor is its 404
(``UpstreamModelNotFound``: it does not serve the model); any other
non-200 answer, an error event or an event that is no completion chunk fails
the attempt (``UpstreamFailed``), so it is retried on another worker. None of
them carries the worker's own words to the client (``gateway.upstream.client``).

The request URL is rebuilt from the registered URL's parts
(``hedgerow.endpoints``), never by gluing a path onto what a worker sent.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import anyio
import orjson

from gateway.upstream.client import WorkerClient, WorkerResponse, map_upstream_errors
from hedgerow.endpoints import BadEndpoint, Endpoint, parse_endpoint
from hedgerow import tracing
from hedgerow.errors import UpstreamFailed
from hedgerow.sse import SseEvent, SseOverflow, SseParser
from hedgerow.wire import WorkerRecord, WorkerRegistration

MAX_DETAIL_CHARS = 512  # of a bad event, kept for the log


@dataclass(frozen=True)
class UpstreamCall:
    """What to send to a worker: the path and the (always streaming) body."""

    request_id: str
    path: str
    body: bytes
    model: str


@dataclass(eq=False)
class Attempt:
    """A live upstream stream that has produced its first token."""

    worker: WorkerRecord
    hedged: bool
    response: WorkerResponse
    events: AsyncIterator[SseEvent]
    first: list[SseEvent] = field(default_factory=list)
    ttft_s: float = 0.0
    first_token_at: float = 0.0  # monotonic: when the first token arrived from the worker
    span: Any = tracing.NO_SPAN  # the attempt's own (``hedgerow.tracing``), ended with it

    @property
    def worker_id(self) -> str:
        return self.worker.registration.worker_id

    @property
    def pool(self) -> str:
        return self.worker.registration.kind

    async def aclose(self) -> None:
        """Close the events, the response and the span: each even if the one before raised."""
        try:
            try:
                await self.events.aclose()  # type: ignore[attr-defined]
            finally:
                await self.response.aclose()
        finally:
            self.span.end()


def upstream_chunk(event: SseEvent) -> dict[str, Any] | None:
    """The completion chunk a worker event carries (None for ``[DONE]``).

    UpstreamFailed for anything else: an error event (``{"error": ...}``), an
    event that is not JSON, or a JSON object that is no chunk — an upstream's
    own words never reach a client; the detail goes to the log.
    """
    if event.data == "[DONE]":
        return None
    excerpt = event.data[:MAX_DETAIL_CHARS]
    try:
        chunk: Any = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        chunk = None
    if not isinstance(chunk, dict):
        raise UpstreamFailed(f"sent an event that is not a JSON object: {excerpt!r}",
                             code="upstream_malformed")
    if "error" in chunk:
        raise UpstreamFailed(f"sent an error event: {excerpt!r}", code="upstream_error")
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not (choices or chunk.get("usage")):
        raise UpstreamFailed(f"sent an event that is not a completion chunk: {excerpt!r}",
                             code="upstream_malformed")
    if choices and not isinstance(choices[0], dict):
        raise UpstreamFailed(f"sent a chunk with a malformed choice: {excerpt!r}",
                             code="upstream_malformed")
    return chunk


# Delta fields that are generated output: a streamed tool call or reasoning
# starts an answer as surely as text does (first token, hedging, TTFT timeout).
OUTPUT_DELTA_FIELDS = ("content", "tool_calls", "reasoning_content", "reasoning", "refusal")


def carries_output(chunk: dict[str, Any] | None) -> bool:
    """True for a token, a finish or the end (None): anything but a bare role chunk."""
    if chunk is None or not chunk.get("choices"):
        return True
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict):
        return True  # malformed: let the relay refuse it
    return bool(any(delta.get(name) for name in OUTPUT_DELTA_FIELDS)
                or choice.get("text") or choice.get("finish_reason"))


def request_url(registration: WorkerRegistration, path: str) -> str:
    """Where to send ``path`` (the gateway's own route) for this worker."""
    try:
        return _endpoint(registration.url, registration.external).url_for(path)
    except BadEndpoint as error:
        raise UpstreamFailed(f"worker {registration.worker_id} has an unusable URL "
                             f"{registration.url!r}: {error}",
                             code="upstream_misconfigured") from None


@lru_cache(maxsize=4096)
def _endpoint(url: str, external: bool) -> Endpoint:
    # Workers register themselves: held to the strict form (an origin, nothing
    # more) here too, whatever the registry let through. Only an operator's
    # external upstream may carry a path prefix or rely on a default port.
    return parse_endpoint(url, strict=not external)


def external_request(worker: WorkerRecord, call: UpstreamCall) -> tuple[bytes, dict[str, str]]:
    """The body and extra headers for ``worker``: an external upstream may know the
    model by another name, and may want a bearer key that this gateway reads from
    its own environment (the registry only names the variable)."""
    registration = worker.registration
    body = call.body
    upstream_model = registration.upstream_model(call.model)
    if upstream_model != call.model:
        data: dict[str, Any] = orjson.loads(body)
        data["model"] = upstream_model
        body = orjson.dumps(data)
    if registration.api_key_env is None:
        return body, {}
    key = os.environ.get(registration.api_key_env)
    if not key:  # the variable's name is for the operator's log, not the client
        raise UpstreamFailed(f"worker {registration.worker_id} needs a key in "
                             f"${registration.api_key_env}, which this gateway lacks",
                             code="upstream_key_missing")
    return body, {"authorization": f"Bearer {key}"}


async def upstream_events(worker_id: str, response: WorkerResponse) -> AsyncIterator[SseEvent]:
    # The response's own generator, its errors mapped here: one generator fewer per token.
    parser = SseParser()
    async with aclosing(response.chunks()) as chunks:  # type: ignore[type-var]
        with map_upstream_errors(worker_id):
            async for data in chunks:
                try:
                    events = parser.feed(data)
                except (SseOverflow, UnicodeDecodeError) as error:
                    raise UpstreamFailed(f"worker {worker_id} sent a malformed stream: {error}",
                                         code="upstream_malformed") from error
                for event in events:
                    yield event


async def start_attempt(
    workers: WorkerClient, worker: WorkerRecord, call: UpstreamCall, *, hedged: bool,
    ttft_timeout_s: float, span: Any = tracing.NO_SPAN,
) -> Attempt:
    """Open the stream on ``worker`` and wait for its first token, within the TTFT timeout.

    The timeout covers the wait for the response headers too: a worker starts
    its response only when its first token is ready.
    """
    with anyio.move_on_after(ttft_timeout_s):
        return await _open_until_first_token(workers, worker, call, hedged, time.monotonic(),
                                             span)
    raise UpstreamFailed(f"worker {worker.registration.worker_id} sent no token within "
                         f"{ttft_timeout_s:.1f}s", code="ttft_timeout")


async def _open_until_first_token(
    workers: WorkerClient, worker: WorkerRecord, call: UpstreamCall, hedged: bool, started: float,
    span: Any,
) -> Attempt:
    worker_id = worker.registration.worker_id
    url = request_url(worker.registration, call.path)
    body, headers = external_request(worker, call)
    tracing.inject(span, headers)  # the worker's (or upstream's) spans continue this trace
    response = await workers.open_stream(worker_id, url, body, call.request_id, headers,
                                         internal=not worker.registration.external)
    try:
        attempt = Attempt(worker, hedged, response, upstream_events(worker_id, response),
                          span=span)
        async for event in attempt.events:
            attempt.first.append(event)
            if carries_output(upstream_chunk(event)):
                attempt.first_token_at = time.monotonic()
                attempt.ttft_s = attempt.first_token_at - started
                return attempt
        raise UpstreamFailed(f"worker {worker_id} ended its stream before any token",
                             code="upstream_truncated")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await response.aclose()
        raise
