"""The gateway's OpenAI-compatible API.

Request path: identify the tenant, read the body within the policy's limit,
validate, resolve the model, and build a ``Ticket`` (class deadline, token
estimate, route preferences). The scheduler actor admits it or refuses it at
once (429/503, never touching a worker), then assigns it a worker slot in
deadline order; the dispatcher gets its first token (retrying or hedging as
needed); the relay streams the rest. A client that goes away cancels all of
it, which stops the generation upstream.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from gateway.attempt import UpstreamCall, WorkerRejected
from gateway.dispatch import Dispatcher
from gateway.drain import Drain, InFlight
from gateway.metrics import CLIENT_CLOSED, GatewayMetrics, RequestMetrics, status_of
from gateway.page import CHAT_PAGE
from gateway.relay import RelayOutcome, collect, completion_body, stream_to_client
from gateway.tickets import Outcome, Reconfigure, Stats, Submit, Ticket, TicketDone
from hedgerow import openai_api as oa
from hedgerow.actors import ActorRef
from hedgerow.asgi import (
    Headers,
    Receive,
    Request,
    Router,
    Scope,
    Send,
    cancel_on_disconnect,
    send_bytes,
    sse_event,
    send_json,
    send_text,
)
from hedgerow.errors import (
    GatewayDraining,
    InvalidRequest,
    ModelNotFound,
    UnsupportedMediaType,
    UpstreamFailed,
)
from hedgerow.latest import LatestValue
from hedgerow.logs import request_id_var
from hedgerow.metrics import CONTENT_TYPE
from hedgerow.wire import RegistrySnapshot
from policies.schema import Policy
from policies.scoring import RouteRequest
from policies.tenancy import Identity, identify

log = logging.getLogger("hedgerow.gateway")


@dataclass
class GatewayApp:
    policy: Policy
    directory: LatestValue[RegistrySnapshot]
    scheduler: ActorRef
    dispatcher: Dispatcher
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    drain: Drain = field(default_factory=Drain)

    def __post_init__(self) -> None:
        self.router = Router()
        self.router.add("GET", "/", self.page)
        self.router.add("GET", "/healthz", self.healthz)
        self.router.add("GET", "/readyz", self.readyz)
        self.router.add("GET", "/metrics", self.prometheus)
        self.router.add("GET", "/v1/models", self.models)
        self.router.add("POST", "/v1/chat/completions", self.chat)
        self.router.add("POST", "/v1/completions", self.completions)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = uuid.uuid4().hex
        scope["hedgerow.request_id"] = request_id
        logged_as = request_id_var.set(request_id)
        try:
            await self.router.serve(scope, receive, send,
                                    lambda _: [(b"x-request-id", request_id.encode())])
        finally:
            request_id_var.reset(logged_as)

    async def apply_policy(self, policy: Policy) -> None:
        """Make ``policy`` govern every request that arrives from now on.

        One attribute swap on the event loop, so no request sees half of it;
        requests already in flight keep the policy they started with.
        """
        self.policy = policy
        self.dispatcher.policy = policy
        await self.scheduler.tell(Reconfigure(policy))

    # -- plain routes ---------------------------------------------------

    async def page(self, request: Request) -> None:
        await send_text(request.send, 200, CHAT_PAGE, b"text/html; charset=utf-8")

    async def healthz(self, request: Request) -> None:
        await send_json(request.send, 200, {"status": "ok"})

    async def readyz(self, request: Request) -> None:
        live = [w for w in self.directory.value.workers if not w.load.draining]
        ready = bool(live) and not self.drain.draining
        body = {"ready": ready, "workers": len(live), "models": list(self._models()),
                "draining": self.drain.draining}
        await send_json(request.send, 200 if ready else 503, body)

    async def prometheus(self, request: Request) -> None:
        stats = await self.scheduler.ask(Stats())
        body = self.metrics.render(stats, self.directory.value)
        await send_bytes(request.send, 200, body, content_type=CONTENT_TYPE)

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
        observed = self.metrics.request(time.monotonic())
        try:
            if not await self._complete_observed(request, shape, observed):
                observed.responded(CLIENT_CLOSED)
        except BaseException as error:
            observed.responded(status_of(error))
            raise
        finally:
            observed.finished(time.monotonic())

    async def _complete_observed(
        self, request: Request, shape: type[oa.ChatCompletionRequest] | type[oa.CompletionRequest],
        observed: RequestMetrics,
    ) -> bool:
        """Serve one completion; False when the client left before it was done."""
        if self.drain.draining:
            raise GatewayDraining("this gateway is shutting down; retry", retry_after=1)
        # The policy in force when the request arrived governs it to the end,
        # even if a new version is swapped in meanwhile.
        policy = self.policy
        identity = identify(policy, request.header("authorization"))
        observed.klass = identity.priority_class
        _require_json(request)
        body = await request.body(policy.limits.max_body_bytes)
        parsed = oa.parse_request(body, shape)
        _check_limits(policy, parsed)
        model = policy.canonical_model(parsed.model)
        self._ensure_model_known(policy, model)
        observed.labelled(model, identity.priority_class)
        ticket = self._ticket(policy, request, identity, parsed, model)
        call = UpstreamCall(ticket.request_id, request.path, _upstream_body(body, model), model)
        chat = isinstance(parsed, oa.ChatCompletionRequest)
        with self.drain.track() as in_flight:
            request.send = in_flight.watch(request.send)
            return await cancel_on_disconnect(
                request, lambda: self._serve(request, ticket, call, parsed, chat, observed))
        await _end_cut_request(request, in_flight)
        return True

    def _ticket(self, policy: Policy, request: Request, identity: Identity,
                parsed: oa.ChatCompletionRequest | oa.CompletionRequest, model: str) -> Ticket:
        now = time.monotonic()
        klass = policy.priority_class(identity.priority_class)
        asked = request.header("x-hedgerow-deadline-ms")
        deadline_ms = _tighter_deadline(klass.deadline_ms, asked)
        # Served in order of first-token due time: the class's SLO, or sooner
        # when the client asked for a tighter deadline than that.
        due_ms = klass.ttft_slo_ms if asked is None else min(klass.ttft_slo_ms, deadline_ms)
        prompt_tokens = estimate_prompt_tokens(parsed)
        route = RouteRequest(
            prompt_tokens=prompt_tokens,
            prefix_key=prefix_key(model, parsed),
            prefer_gpu_above_tokens=policy.routing.prefer_gpu_above_tokens,
            allow_cpu_fallback=policy.routing.allow_cpu_fallback,
        )
        return Ticket(
            request_id=request.scope["hedgerow.request_id"], tenant=identity.tenant,
            model=model, arrival=now, due=now + due_ms / 1000, deadline=now + deadline_ms / 1000,
            estimated_tokens=prompt_tokens + (parsed.token_limit() or DEFAULT_OUTPUT_ESTIMATE),
            # Only idempotent requests race on two workers.
            route=route, hedgeable=klass.hedge and not parsed.store, policy=policy)

    async def _serve(self, request: Request, ticket: Ticket, call: UpstreamCall,
                     parsed: oa.ChatCompletionRequest | oa.CompletionRequest, chat: bool,
                     observed: RequestMetrics) -> None:
        refusal = await self.scheduler.ask(Submit(ticket))
        if refusal is not None:
            raise refusal.to_error()
        self.metrics.cache_lookup("miss")  # no cache yet
        relayed = RelayOutcome()
        try:
            relayed = await self._serve_admitted(request, ticket, call, parsed, chat, observed)
        finally:
            with anyio.CancelScope(shield=True):
                await self.scheduler.tell(TicketDone(ticket, relayed.total_tokens))

    async def _serve_admitted(
        self, request: Request, ticket: Ticket, call: UpstreamCall,
        parsed: oa.ChatCompletionRequest | oa.CompletionRequest, chat: bool,
        observed: RequestMetrics,
    ) -> RelayOutcome:
        try:
            attempt = await self.dispatcher.first_token(ticket, call)
        except WorkerRejected as rejected:
            observed.responded(rejected.status)
            await _send_rejection(request, rejected, ticket.request_id)
            return RelayOutcome()
        finally:
            observed.dispatched(ticket.arrival, ticket.assigned_at, ticket.upstream_at)
        if attempt.hedged:
            self.metrics.hedge_won()
        outcome: RelayOutcome | None = None
        try:
            headers: Headers = [
                (b"x-request-id", ticket.request_id.encode()),
                (b"x-hedgerow-worker", attempt.worker_id.encode()),
                (b"x-hedgerow-cache", b"miss"),
                (b"x-hedgerow-hedged", b"1" if attempt.hedged else b"0"),
            ]
            if parsed.stream:
                observed.responded(200)
                outcome = await stream_to_client(request, attempt, headers,
                                                 parsed.include_usage(), observed)
            else:
                try:
                    outcome = await collect(attempt)
                except UpstreamFailed:
                    outcome = RelayOutcome(failed=True)  # feeds the breaker, then a 502
                    raise
                body = completion_body(ticket.request_id, ticket.model, outcome, chat)
                observed.responded(200)
                await send_bytes(request.send, 200, body, headers)
            return outcome
        finally:
            with anyio.CancelScope(shield=True):
                await attempt.aclose()
                result: Outcome = "abandoned" if outcome is None else (
                    "failure" if outcome.failed else "success")
                await self.dispatcher.report(attempt.worker_id, result)

    def _ensure_model_known(self, policy: Policy, model: str) -> None:
        if policy.declares_model(model) or model in self.directory.value.models():
            return
        raise ModelNotFound(f"the model {model!r} does not exist", param="model")


def _check_limits(policy: Policy, parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> None:
    limits = policy.limits
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


DEFAULT_OUTPUT_ESTIMATE = 256


def estimate_prompt_tokens(parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> int:
    """About four characters a token: good enough to admit and route by."""
    if isinstance(parsed, oa.ChatCompletionRequest):
        chars = sum(len(m.text()) + 8 for m in parsed.messages)
    else:
        chars = len(parsed.prompt)
    return max(1, chars // 4)


def prefix_key(model: str, parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> str | None:
    """The conversation so far (all but the newest message), for prompt-cache affinity."""
    if not isinstance(parsed, oa.ChatCompletionRequest) or len(parsed.messages) < 2:
        return None
    earlier = [(m.role, m.text()) for m in parsed.messages[:-1]]
    return hashlib.blake2b(orjson.dumps([model, earlier]), digest_size=16).hexdigest()


def _tighter_deadline(class_deadline_ms: int, header: str | None) -> int:
    if header is None:
        return class_deadline_ms
    if not header.strip().isdigit() or int(header) < 1:
        raise InvalidRequest("x-hedgerow-deadline-ms must be a positive integer",
                             param="x-hedgerow-deadline-ms")
    return min(class_deadline_ms, int(header))


def _upstream_body(body: bytes, model: str) -> bytes:
    """Workers are always asked to stream, with usage, for the canonical model name."""
    data: dict[str, Any] = orjson.loads(body)
    data["model"] = model
    data["stream"] = True
    data["stream_options"] = {"include_usage": True}
    return orjson.dumps(data)


async def _end_cut_request(request: Request, in_flight: InFlight) -> None:
    """The drain deadline cut this request: end it explicitly, never silently."""
    draining = GatewayDraining("the gateway shut down before the response was complete",
                               retry_after=1)
    if not in_flight.response_started:
        raise draining
    if in_flight.response_finished:
        return
    event = oa.error_event(draining.message, draining.error_type, draining.code)
    await request.send({"type": "http.response.body", "body": sse_event(event),
                        "more_body": True})
    await request.send({"type": "http.response.body", "body": b""})


async def _send_rejection(request: Request, rejected: WorkerRejected, request_id: str) -> None:
    headers = [(b"content-type", rejected.content_type.encode()),
               (b"x-request-id", request_id.encode())]
    await send_bytes(request.send, rejected.status, rejected.body, headers[1:],
                     content_type=rejected.content_type.encode())


def _require_json(request: Request) -> None:
    content_type = (request.header("content-type") or "application/json").lower()
    if "json" not in content_type:
        raise UnsupportedMediaType(f"content-type must be application/json, not {content_type!r}")
