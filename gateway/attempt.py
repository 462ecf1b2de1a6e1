"""One attempt of a request on one worker, up to its first token.

``start_attempt`` opens the worker's stream and reads SSE events until the
first one that carries output (a token, or the finish); only then is the
attempt worth relaying. Everything before that point can still be retried or
raced by a hedge without the client noticing. A worker's 4xx is the client's
own mistake and is returned as ``WorkerRejected`` so it reaches the client
unchanged instead of being retried.

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

from gateway.upstream import WorkerClient, WorkerResponse
from hedgerow.endpoints import BadEndpoint, Endpoint, parse_endpoint
from hedgerow.errors import HedgerowError, UpstreamFailed
from hedgerow.sse import SseEvent, SseOverflow, SseParser
from hedgerow.wire import WorkerRecord, WorkerRegistration

MAX_REJECTION_BYTES = 64 * 1024


class WorkerRejected(HedgerowError):
    """The worker refused the request as invalid (4xx): pass it through."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"worker rejected the request with {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


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

    @property
    def worker_id(self) -> str:
        return self.worker.registration.worker_id

    @property
    def pool(self) -> str:
        return self.worker.registration.kind

    async def aclose(self) -> None:
        await self.events.aclose()  # type: ignore[attr-defined]
        await self.response.aclose()


def carries_output(event: SseEvent) -> bool:
    """True for a token, a finish, an error or the end: anything but a bare role chunk."""
    if event.data == "[DONE]":
        return True
    try:
        chunk: Any = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return True
    if "error" in chunk or not chunk.get("choices"):
        return True
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or choice.get("text") or choice.get("finish_reason"))


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
    if not key:
        raise UpstreamFailed(f"worker {registration.worker_id} needs a key in "
                             f"${registration.api_key_env}, which this gateway lacks",
                             code="upstream_key_missing")
    return body, {"authorization": f"Bearer {key}"}


async def upstream_events(worker_id: str, response: WorkerResponse) -> AsyncIterator[SseEvent]:
    parser = SseParser()
    async with aclosing(WorkerClient.chunks(worker_id, response)) as chunks:
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
    ttft_timeout_s: float,
) -> Attempt:
    """Open the stream on ``worker`` and wait for its first token, within the TTFT timeout.

    The timeout covers the wait for the response headers too: a worker starts
    its response only when its first token is ready.
    """
    with anyio.move_on_after(ttft_timeout_s):
        return await _open_until_first_token(workers, worker, call, hedged, time.monotonic())
    raise UpstreamFailed(f"worker {worker.registration.worker_id} sent no token within "
                         f"{ttft_timeout_s:.1f}s", code="ttft_timeout")


async def _open_until_first_token(
    workers: WorkerClient, worker: WorkerRecord, call: UpstreamCall, hedged: bool, started: float,
) -> Attempt:
    worker_id = worker.registration.worker_id
    url = request_url(worker.registration, call.path)
    body, headers = external_request(worker, call)
    response = await workers.open_stream(worker_id, url, body, call.request_id, headers)
    try:
        if response.status != 200:
            body = await WorkerClient.read_all(worker_id, response, MAX_REJECTION_BYTES)
            raise WorkerRejected(response.status, body,
                                 response.headers.get("content-type", "application/json"))
        attempt = Attempt(worker, hedged, response, upstream_events(worker_id, response))
        async for event in attempt.events:
            attempt.first.append(event)
            if carries_output(event):
                attempt.first_token_at = time.monotonic()
                attempt.ttft_s = attempt.first_token_at - started
                return attempt
        raise UpstreamFailed(f"worker {worker_id} ended its stream before any token",
                             code="upstream_truncated")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await response.aclose()
        raise
