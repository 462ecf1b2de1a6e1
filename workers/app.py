"""The worker's OpenAI-compatible HTTP API over a model ``Backend``.

Each token is written to the response the moment the backend yields it; when
the caller disconnects, the stream is cancelled, which closes the backend's
generation (it stops within one token and frees its slot).

A streamed response starts only once the backend produced its first event, so
a generation that fails before its first token is answered with its error
status (a 500 the gateway can retry elsewhere). A generation that fails after
the 200 went out (any ``HedgerowError`` from the stream, e.g. the simulated
backend's ``SimulatedStreamBreak``) cannot change the status any more: the
response is left unfinished, so Hypercorn drops the HTTP/1.1 connection (how
workers are served) and the caller sees a broken stream, never a clean end.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import anyio
import orjson

from hedgerow import openai_api as oa
from hedgerow import tracing
from hedgerow.asgi import (
    SSE_DONE,
    SSE_HEADERS,
    Headers,
    Receive,
    Request,
    Router,
    Scope,
    Send,
    send_bytes,
    send_json,
    sse_event,
    stream_until_disconnect,
    wait_for_disconnect,
)
from hedgerow.errors import HedgerowError, ModelNotFound, NoHealthyWorker
from hedgerow.completion_fold import CompletionFold
from hedgerow.logs import request_id_var, safe_request_id
from hedgerow.metrics import CONTENT_TYPE
from workers.backend import (
    Backend,
    Finished,
    GenerationEvent,
    GenerationRequest,
    GenerationStream,
    SeveralChoices,
    TokenChunk,
    ToolCallDelta,
)
from workers.sim_embeddings import SimEmbedder
from workers.tool_calls import ToolSpec
from workers.metrics import GenerationTiming, WorkerMetrics

log = logging.getLogger("hedgerow.worker")

MAX_BODY = 4 * 1024 * 1024


@dataclass
class WorkerState:
    worker_id: str
    draining: bool = False
    ready: bool = True


@dataclass
class WorkerApp:
    backend: Backend
    state: WorkerState
    # ``POST /v1/embeddings``: the simulated embedding model, when one is served.
    embedder: SimEmbedder | None = None
    router: Router = field(init=False)
    metrics: WorkerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = WorkerMetrics(self.backend.load, lambda: self.state.draining)
        self.router = Router()
        self.router.add("GET", "/healthz", self.healthz)
        self.router.add("GET", "/readyz", self.readyz)
        self.router.add("GET", "/status", self.status)
        self.router.add("GET", "/metrics", self.prometheus)
        self.router.add("GET", "/v1/models", self.models)
        self.router.add("POST", "/v1/chat/completions", self.chat)
        self.router.add("POST", "/v1/completions", self.completions)
        self.router.add("POST", "/v1/embeddings", self.embeddings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Logs while serving carry the id the gateway sent (when it looks like one).
        logged_as = request_id_var.set(_request_id_header(scope))
        try:
            await self.router.serve(scope, receive, send)
        finally:
            request_id_var.reset(logged_as)

    async def healthz(self, request: Request) -> None:
        await send_json(request.send, 200, {"status": "ok"})

    async def readyz(self, request: Request) -> None:
        ok = self.state.ready and not self.state.draining
        body: dict[str, Any] = {"ready": ok}
        if not self.state.ready:
            body["warming"] = True  # loaded, still running its warm-up generation
        await send_json(request.send, 200 if ok else 503, body)

    async def status(self, request: Request) -> None:
        body: dict[str, Any] = {
            "worker_id": self.state.worker_id,
            "draining": self.state.draining,
            "ready": self.state.ready,
            "kind": self.backend.kind,
            "device": self.backend.device,
            "device_memory_bytes": self.backend.device_memory_bytes,
            "models": list(self.backend.models),
            "slots": self.backend.slots,
            **asdict(self.backend.load()),
        }
        await send_json(request.send, 200, body)

    async def prometheus(self, request: Request) -> None:
        await send_bytes(request.send, 200, self.metrics.render(), content_type=CONTENT_TYPE)

    async def models(self, request: Request) -> None:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "hedgerow"}
            for name in self.backend.models
        ]
        if self.embedder is not None:
            data.append({"id": self.embedder.model_name, "object": "model", "created": 0,
                         "owned_by": "hedgerow", "kind": "embedding"})
        await send_json(request.send, 200, {"object": "list", "data": data})

    async def embeddings(self, request: Request) -> None:
        if self.embedder is None:
            raise ModelNotFound("this worker serves no embedding model", param="model")
        answer = self.embedder.answer(oa.decode_request(await request.body(MAX_BODY)))
        await send_json(request.send, 200, answer)

    async def chat(self, request: Request) -> None:
        parsed = oa.parse_request(await request.body(MAX_BODY), oa.ChatCompletionRequest)
        messages = tuple(m.for_model() for m in parsed.messages)
        await self._generate(request, parsed, GenerationRequest(
            messages=messages, prompt=None, **_sampling(parsed), **_chat_options(parsed)),
            chat=True)

    async def completions(self, request: Request) -> None:
        parsed = oa.parse_request(await request.body(MAX_BODY), oa.CompletionRequest)
        await self._generate(request, parsed, GenerationRequest(
            messages=None, prompt=parsed.prompt, **_sampling(parsed)), chat=False)

    async def _generate(
        self, request: Request, parsed: oa._Sampling, generation: GenerationRequest, *, chat: bool
    ) -> None:
        if parsed.model not in self.backend.models:
            raise ModelNotFound(f"model {parsed.model!r} is not served by this worker")
        if self.state.draining:
            raise NoHealthyWorker("worker is draining", retry_after=1)
        if not self.state.ready:  # the warm-up generation still holds the model
            raise NoHealthyWorker("worker is warming up", retry_after=1)
        request_id = request.header("x-request-id") or uuid.uuid4().hex
        timing = GenerationTiming(started=time.monotonic())
        stream = _ResponseStream(request_id, parsed.model, oa.now_created(), chat,
                                 parsed.include_usage(), timing)
        events = self._choices(generation, parsed.n)
        headers = [(b"x-request-id", request_id.encode())]
        # The gateway's attempt span is the parent (its traceparent): prefill and
        # decode show where a slow first token or a slow stream came from.
        with tracing.server_span("chat" if chat else "text_completion",
                                 request.scope["headers"],
                                 _span_attributes(request_id, parsed.model, chat)) as span:
            try:
                if parsed.stream:
                    await _stream_sse(request, stream, events, list(SSE_HEADERS) + headers)
                else:
                    await send_json(request.send, 200, await stream.whole(events), headers)
            except Exception:
                timing.failed = True
                raise
            finally:
                self.metrics.generation_done(parsed.model, timing)
                if span.is_recording():
                    _record_phases(span, timing, time.monotonic())


    def _choices(self, generation: GenerationRequest, n: int) -> GenerationStream:
        """One stream for ``n`` choices; each draws its own seed (from the client's, if it
        gave one, so that n answers are n different answers, reproducibly)."""
        first = self.backend.generate(generation)  # a bad request fails here, before any slot
        if n == 1:
            return first
        def choice(index: int) -> Callable[[], GenerationStream]:
            seed = None if generation.seed is None else generation.seed + index
            return lambda: self.backend.generate(replace(generation, seed=seed))
        return SeveralChoices(first, [choice(i) for i in range(1, n)])


async def _stream_sse(
    request: Request, stream: _ResponseStream, events: GenerationStream, headers: Headers
) -> None:
    """Start the 200 at the first event; a later failure leaves the response unfinished."""
    async with aclosing(events):
        first = await _first_event_unless_disconnected(request, events)
        if first is None:
            return
        stream.timing.saw(first, time.monotonic())
        try:
            await stream_until_disconnect(request, 200, headers, stream.sse(first, events))
        except* HedgerowError as failures:
            stream.timing.failed = True
            # Returning without the final body makes Hypercorn drop the connection.
            log.warning("stream %s broke after it started: %s", stream.request_id, failures.exceptions[0])


async def _first_event_unless_disconnected(
    request: Request, events: GenerationStream
) -> GenerationEvent | None:
    """The first event (raising its error, if any); None if the caller left before it."""
    outcome: list[GenerationEvent | HedgerowError] = []
    async with anyio.create_task_group() as tg:

        async def read_first() -> None:
            try:
                outcome.append(await events.__anext__())
            except HedgerowError as error:
                outcome.append(error)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            await wait_for_disconnect(request.receive)
            tg.cancel_scope.cancel()

        tg.start_soon(read_first)
        tg.start_soon(watch)
    first = outcome[0] if outcome else None
    if isinstance(first, HedgerowError):
        raise first
    return first


def _span_attributes(request_id: str, model: str,
                     chat: bool) -> dict[str, tracing.AttributeValue] | None:
    if not tracing.enabled():
        return None
    return {tracing.GEN_AI_OPERATION: "chat" if chat else "text_completion",
            tracing.GEN_AI_REQUEST_MODEL: model, "hedgerow.request_id": request_id}


def _record_phases(span: Any, timing: GenerationTiming, now: float) -> None:
    """Prefill (to the first token) and decode (from it to the last) as child spans,
    from the times the generation already took for its metrics."""
    first = timing.first_token_at or timing.first_at
    span.set_attributes({"hedgerow.generation.outcome": timing.outcome,
                         "hedgerow.generation.token_chunks": timing.token_chunks})
    if timing.finish_reason:
        span.set_attribute(tracing.GEN_AI_FINISH_REASONS, (timing.finish_reason,))
    if timing.failed:
        tracing.failed(span, "generation_failed")
    if first is None:
        tracing.record_span("prefill", timing.started, now, {"hedgerow.completed": False})
        return
    tracing.record_span("prefill", timing.started, first)
    tracing.record_span("decode", first, timing.last_token_at or now,
                        {"hedgerow.generation.token_chunks": timing.token_chunks})


def _request_id_header(scope: Scope) -> str | None:
    for key, value in scope.get("headers", ()):
        if bytes(key).lower() == b"x-request-id":
            return safe_request_id(bytes(value).decode("latin-1"))
    return None


def _sampling(parsed: oa._Sampling) -> dict[str, Any]:
    return {
        "max_tokens": parsed.token_limit(),
        "temperature": parsed.temperature,
        "top_p": parsed.top_p,
        "seed": parsed.seed,
        "stop": parsed.stop_sequences(),
        "presence_penalty": parsed.presence_penalty,
        "frequency_penalty": parsed.frequency_penalty,
        "logit_bias": parsed.token_biases(),
    }


def _chat_options(parsed: oa.ChatCompletionRequest) -> dict[str, Any]:
    """Tools, response format and logprobs, as the backend takes them."""
    tools = tuple(ToolSpec(t.function.name, t.function.description or "",
                           orjson.dumps(t.function.parameters or {}).decode())
                  for t in parsed.tools or ())
    schema: str | None = None
    shape = parsed.response_format
    if shape is not None and shape.type == "json_object":
        schema = '{"type": "object"}'
    elif shape is not None and shape.json_schema is not None:
        schema = orjson.dumps(shape.json_schema.schema_ or {"type": "object"}).decode()
    return {"tools": tools, "tool_mode": parsed.tool_mode(), "response_schema": schema,
            "logprobs": parsed.logprobs, "top_logprobs": parsed.top_logprobs or 0}


@dataclass
class _ResponseStream:
    """Turns backend events into OpenAI chunks (SSE) or one whole response."""

    request_id: str
    model: str
    created: int
    chat: bool
    include_usage: bool
    timing: GenerationTiming
    _opened: int = 0  # the last choice whose role chunk went out

    def _delta(self, text: str, choice: int, finish: str | None = None,
               logprobs: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text else {}
            shown = {"content": list(logprobs), "refusal": None} if logprobs else None
            return oa.chat_chunk(self.request_id, self.model, self.created, delta, finish, shown,
                                 choice)
        chunk = oa.text_chunk(self.request_id, self.model, self.created, text, finish)
        chunk["choices"][0]["index"] = choice
        return chunk

    def _role(self, choice: int) -> dict[str, Any]:
        role = {"role": "assistant", "content": ""}
        return oa.chat_chunk(self.request_id, self.model, self.created, role, index=choice)

    def chunks(self, event: GenerationEvent) -> list[dict[str, Any]]:
        """The OpenAI chunks that carry one backend event (a choice after the first
        opens with its own role chunk)."""
        opened: list[dict[str, Any]] = []
        if event.choice > self._opened:
            self._opened = event.choice
            opened = [self._role(event.choice)] if self.chat else []
        if isinstance(event, TokenChunk):
            return opened + [self._delta(event.text, event.choice, logprobs=event.logprobs)]
        if isinstance(event, ToolCallDelta):
            call: dict[str, Any] = {"index": event.index,
                                    "function": {"arguments": event.arguments}}
            if event.id is not None:
                call.update(id=event.id, type="function")
                call["function"]["name"] = event.name
            delta = {"tool_calls": [call]}
            return opened + [oa.chat_chunk(self.request_id, self.model, self.created, delta,
                                           index=event.choice)]
        finished = opened + [self._delta("", event.choice, event.finish_reason)]
        if self.include_usage and event.final:
            used = oa.usage(event.prompt_tokens, event.completion_tokens)
            finished.append(oa.usage_chunk(self.request_id, self.model, self.created, used))
        return finished

    async def sse(
        self, first: GenerationEvent, events: GenerationStream
    ) -> AsyncGenerator[bytes, None]:
        """``first`` (already read) and then the rest of ``events`` as SSE chunks."""
        if self.chat:
            yield sse_event(self._role(0))
        async with aclosing(events):
            event: GenerationEvent | None = first
            while event is not None:
                for chunk in self.chunks(event):
                    yield sse_event(chunk)
                event = await anext(events, None)
                if event is not None:
                    self.timing.saw(event, time.monotonic())
        yield SSE_DONE

    async def whole(self, events: GenerationStream) -> dict[str, Any]:
        fold = CompletionFold()
        async with aclosing(events):
            async for event in events:
                self.timing.saw(event, time.monotonic())
                for chunk in self.chunks(event):
                    fold.feed(chunk)
                if not isinstance(event, Finished) or not event.final:
                    continue
                used = oa.usage(event.prompt_tokens, event.completion_tokens)
                if self.chat:
                    return oa.chat_completion_of(self.request_id, self.model, self.created,
                                                 fold.chat_choices(), used)
                return oa.text_completion_of(self.request_id, self.model, self.created,
                                             fold.text_choices(), used)
        raise NoHealthyWorker("generation ended without finishing", code="generation_aborted")
