"""The gateway's OpenAI-compatible API.

Request path (foundation): identify the tenant, read the body within the
policy's limit, validate, resolve the model, pick a worker (least in-flight),
open the upstream stream (one invisible retry on another worker if that fails
before anything reached the client), relay SSE events as they arrive, and
cancel upstream when the client goes away.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import orjson

from gateway.page import CHAT_PAGE
from gateway.upstream import WorkerClient
from hedgerow import openai_api as oa
from hedgerow.asgi import (
    SSE_HEADERS,
    Headers,
    Receive,
    Request,
    Router,
    Scope,
    Send,
    handle_lifespan,
    send_error,
    send_json,
    send_text,
    sse_event,
    stream_until_disconnect,
    wait_for_disconnect,
)
from hedgerow.errors import (
    HedgerowError,
    InvalidRequest,
    ModelNotFound,
    NoHealthyWorker,
    UnsupportedMediaType,
    UpstreamFailed,
)
from hedgerow.latest import LatestValue
from hedgerow.sse import SseParser
from hedgerow.wire import RegistrySnapshot, WorkerRecord
from policies.routing import Candidate, pick_least_inflight
from policies.schema import Policy
from policies.tenancy import identify

log = logging.getLogger("hedgerow.gateway")

NO_WORKER_RETRY_AFTER_S = 2.0
MAX_ATTEMPTS = 2


@dataclass
class Dispatch:
    """One request on its way to a worker."""

    request_id: str
    path: str
    body: bytes
    model: str
    stream: bool


@dataclass
class GatewayApp:
    policy: Policy
    directory: LatestValue[RegistrySnapshot]
    workers: WorkerClient
    inflight: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.router = Router()
        self.router.add("GET", "/", self.page)
        self.router.add("GET", "/healthz", self.healthz)
        self.router.add("GET", "/readyz", self.readyz)
        self.router.add("GET", "/v1/models", self.models)
        self.router.add("POST", "/v1/chat/completions", self.chat)
        self.router.add("POST", "/v1/completions", self.completions)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await handle_lifespan(receive, send)
            return
        request = Request(scope, receive, send)
        request_id = uuid.uuid4().hex
        request_headers = [(b"x-request-id", request_id.encode())]
        try:
            handler, request.path_params = self.router.resolve(request.method, request.path)
            request.scope["hedgerow.request_id"] = request_id
            await handler(request)
        except HedgerowError as error:
            await send_error(send, error, request_headers)

    # -- plain routes ---------------------------------------------------

    async def page(self, request: Request) -> None:
        await send_text(request.send, 200, CHAT_PAGE, b"text/html; charset=utf-8")

    async def healthz(self, request: Request) -> None:
        await send_json(request.send, 200, {"status": "ok"})

    async def readyz(self, request: Request) -> None:
        live = [w for w in self.directory.value.workers if not w.load.draining]
        body = {"ready": bool(live), "workers": len(live), "models": list(self._models())}
        await send_json(request.send, 200 if live else 503, body)

    async def models(self, request: Request) -> None:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "hedgerow"}
            for name in self._models()
        ]
        await send_json(request.send, 200, {"object": "list", "data": data})

    def _models(self) -> tuple[str, ...]:
        declared = {m.name for m in self.policy.models}
        return tuple(sorted(declared | set(self.directory.value.models())))

    # -- completions ----------------------------------------------------

    async def chat(self, request: Request) -> None:
        await self._complete(request, oa.ChatCompletionRequest)

    async def completions(self, request: Request) -> None:
        await self._complete(request, oa.CompletionRequest)

    async def _complete(
        self, request: Request, shape: type[oa.ChatCompletionRequest] | type[oa.CompletionRequest]
    ) -> None:
        identify(self.policy, request.header("authorization"))
        _require_json(request)
        body = await request.body(self.policy.limits.max_body_bytes)
        parsed = oa.parse_request(body, shape)
        self._check_limits(parsed)
        model = self.policy.canonical_model(parsed.model)
        self._ensure_model_known(model)
        data: dict[str, Any] = orjson.loads(body)
        data["model"] = model
        dispatch = Dispatch(
            request_id=request.scope["hedgerow.request_id"],
            path=request.path,
            body=orjson.dumps(data),
            model=model,
            stream=parsed.stream,
        )
        await self._dispatch(request, dispatch)

    def _check_limits(self, parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> None:
        limits = self.policy.limits
        if isinstance(parsed, oa.ChatCompletionRequest) and len(parsed.messages) > limits.max_messages:
            raise InvalidRequest(
                f"too many messages: {len(parsed.messages)} > {limits.max_messages}",
                param="messages",
            )
        wanted = parsed.token_limit()
        if wanted is not None and wanted > limits.max_tokens:
            raise InvalidRequest(
                f"max_tokens {wanted} exceeds the limit of {limits.max_tokens}",
                param="max_tokens",
            )

    def _ensure_model_known(self, model: str) -> None:
        if self.policy.declares_model(model) or model in self.directory.value.models():
            return
        raise ModelNotFound(f"the model {model!r} does not exist", param="model")

    # -- dispatch -------------------------------------------------------

    async def _dispatch(self, request: Request, dispatch: Dispatch) -> None:
        worker, response = await self._open_upstream(dispatch)
        try:
            headers: Headers = [
                (b"x-request-id", dispatch.request_id.encode()),
                (b"x-hedgerow-worker", worker.registration.worker_id.encode()),
                (b"x-hedgerow-cache", b"miss"),
                (b"x-hedgerow-hedged", b"0"),
            ]
            worker_id = worker.registration.worker_id
            if response.status_code != 200 or not dispatch.stream:
                await self._relay_whole(request, worker_id, response, headers)
                return
            events = self._relay_events(worker_id, response)
            await stream_until_disconnect(request, 200, list(SSE_HEADERS) + headers, events)
        finally:
            await response.aclose()
            self._release(worker.registration.worker_id)

    async def _open_upstream(self, dispatch: Dispatch) -> tuple[WorkerRecord, httpx.Response]:
        """Pick a worker and open its stream; one retry elsewhere if that fails."""
        tried: list[str] = []
        last_error: UpstreamFailed | None = None
        for _ in range(MAX_ATTEMPTS):
            worker = self._pick(dispatch.model, tried)
            if worker is None:
                break
            worker_id = worker.registration.worker_id
            tried.append(worker_id)
            self.inflight[worker_id] = self.inflight.get(worker_id, 0) + 1
            url = worker.registration.url.rstrip("/") + dispatch.path
            try:
                response = await self.workers.open_stream(worker_id, url, dispatch.body,
                                                          dispatch.request_id)
                return worker, response
            except UpstreamFailed as error:
                self._release(worker_id)
                log.warning("request %s: %s; trying another worker", dispatch.request_id, error)
                last_error = error
        if last_error is not None:
            raise NoHealthyWorker(f"no worker could take the request: {last_error.message}",
                                  retry_after=NO_WORKER_RETRY_AFTER_S)
        raise NoHealthyWorker(f"no healthy worker serves {dispatch.model!r} right now",
                              retry_after=NO_WORKER_RETRY_AFTER_S)

    def _pick(self, model: str, exclude: list[str]) -> WorkerRecord | None:
        records = {w.registration.worker_id: w for w in self.directory.value.serving(model)}
        candidates = [
            Candidate(
                worker_id=w.registration.worker_id,
                slots=w.registration.slots,
                reported_active=w.load.active,
                reported_queued=w.load.queued,
                draining=w.load.draining,
            )
            for w in records.values()
        ]
        chosen = pick_least_inflight(candidates, self.inflight, exclude)
        return None if chosen is None else records[chosen.worker_id]

    def _release(self, worker_id: str) -> None:
        left = self.inflight.get(worker_id, 0) - 1
        if left > 0:
            self.inflight[worker_id] = left
        else:
            self.inflight.pop(worker_id, None)

    async def _relay_whole(
        self, request: Request, worker_id: str, response: httpx.Response, headers: Headers
    ) -> None:
        async with anyio.create_task_group() as tg:

            async def read_and_send() -> None:
                body = await self.workers.read_all(worker_id, response)
                content_type = response.headers.get("content-type", "application/json")
                await request.send({
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(b"content-type", content_type.encode()),
                                (b"content-length", str(len(body)).encode())] + headers,
                })
                await request.send({"type": "http.response.body", "body": body})
                tg.cancel_scope.cancel()

            async def watch() -> None:
                await wait_for_disconnect(request.receive)
                tg.cancel_scope.cancel()

            tg.start_soon(read_and_send)
            tg.start_soon(watch)

    async def _relay_events(self, worker_id: str, response: httpx.Response) -> AsyncIterator[bytes]:
        """Relay the worker's SSE events one by one; a failure ends with an error event."""
        parser = SseParser()
        finished = False
        try:
            async with aclosing(self.workers.chunks(worker_id, response)) as chunks:
                async for data in chunks:
                    for event in parser.feed(data):
                        finished = finished or event.data == "[DONE]"
                        yield event.raw
        except UpstreamFailed as error:
            log.warning("stream from %s failed mid-way: %s", worker_id, error)
            yield sse_event(oa.error_event(error.message, error.error_type, error.code))
            return
        if not finished:
            message = f"worker {worker_id} ended the stream before it was complete"
            yield sse_event(oa.error_event(message, UpstreamFailed.error_type, "upstream_truncated"))


def _require_json(request: Request) -> None:
    content_type = (request.header("content-type") or "application/json").lower()
    if "json" not in content_type:
        raise UnsupportedMediaType(f"content-type must be application/json, not {content_type!r}")
