"""The gateway's OpenAI-compatible API.

Request path: identify the tenant, read the body within the policy's limit,
validate, resolve the model, and build a ``Ticket`` (class deadline, token
estimate, route preferences). The scheduler, called directly through its
door (``gateway.corridor.scheduling``), admits it or refuses it at once (429/503,
never touching a worker), then assigns it a worker slot in deadline order; the dispatcher gets its first token (retrying or hedging as
needed); the relay streams the rest. A client that goes away cancels all of
it, which stops the generation upstream.

This app is the public port: the client API, the chat page, ``/healthz`` and
``/readyz``, nothing else. Metrics (``render_metrics``) are served by the
admin listener (``gateway.admin.api``). Until a policy is in force
(``awaiting_policy``: following the control plane, none received yet) every
client API route answers 503 ``policy_unavailable`` rather than serve under a
built-in default the operator never chose.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from gateway.admin.access_log import AccessLog
from gateway.corridor.attempt import UpstreamCall
from gateway.corridor.dialects import (
    ANTHROPIC_MESSAGES,
    OPENAI_CHAT,
    OPENAI_COMPLETIONS,
    AnthropicSend,
    Dialect,
    anthropic_errors,
)
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.drain import Drain, InFlight
from gateway.corridor import embed_route
from gateway.corridor.embeddings import EmbeddingModel
from gateway.corridor.key_gate import KeyGate
from gateway.admin.metrics import CLIENT_CLOSED, GatewayMetrics, RequestMetrics
from gateway.admin.usage_metrics import policy_prices
from gateway.edge.page import CHAT_PAGE, CHAT_PAGE_CSP
from gateway.cache import Hit, ResponseCache
from gateway.cache.entry import entry_from_fold
from gateway.cache.keys import bypasses_lookup, cacheable
from gateway.corridor.generation import Generation, classify
from gateway.admin.tracing_attributes import describe_request, request_attributes
from gateway.corridor.relay import ClientStalled, RelayOutcome, completion_body, follow_log
from gateway.corridor.stream_log import StreamBook, StreamLog
from gateway.corridor.scheduling import SchedulerDoor
from gateway.corridor.tickets import Ticket
from hedgerow import embeddings_api, tracing
from hedgerow import openai_api as oa
from hedgerow.body_budget import BodyBudget
from hedgerow.asgi import (
    SSE_HEADERS,
    Handler,
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
from hedgerow.decimal_text import MAX_DIGITS, parse_decimal
from hedgerow.errors import (
    GatewayDraining,
    InvalidRequest,
    ModelNotFound,
    PolicyUnavailable,
    StreamGone,
    UnsupportedMediaType,
    UpstreamFailed,
)
from hedgerow.latest import LatestValue
from hedgerow.logs import request_id_var
from hedgerow.sse import SseParser
from hedgerow.wire import RegistrySnapshot
from policies.schema import Policy, PriorityClass
from policies.affinity import conversation_key
from policies.request_limits import check_request_limits
from policies.scoring import RouteRequest
from policies.keys import check_model_allowed
from policies.tenancy import Identity

log = logging.getLogger("hedgerow.gateway")

# The policy follower reconnects within 2 s; a client may come back after that.
POLICY_RETRY_AFTER_S = 2.0


@dataclass
class GatewayApp:
    policy: Policy
    directory: LatestValue[RegistrySnapshot]
    scheduler: SchedulerDoor
    dispatcher: Dispatcher
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    drain: Drain = field(default_factory=Drain)
    # The response cache; None serves every request fresh.
    cache: ResponseCache | None = None
    # True: ``policy`` is a placeholder until ``apply_policy`` brings the first
    # real one; the client API refuses until then.
    awaiting_policy: bool = False
    # Bytes of request bodies being read at once, across all requests (503 beyond).
    body_budget: BodyBudget = field(default_factory=BodyBudget)
    # One JSON line per completion request on the ``hedgerow.access`` logger.
    access_log: AccessLog = field(default_factory=AccessLog)
    # Identity (legacy digests and virtual keys), key allowlists, limits, budgets.
    keys: KeyGate = field(default_factory=KeyGate)
    streams: StreamBook = field(init=False)
    _flights: dict[str, Flight] = field(init=False, default_factory=dict)
    # /v1/embeddings: the semantic cache's embedder (None: no cache, no route to it).
    embedding: EmbeddingModel | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.cache is not None:
            self.embedding = EmbeddingModel(self.cache.embedder)
        self.streams = StreamBook(max_streams=1, max_total_bytes=1, retain_s=0)
        self._configure_streams(self.policy)
        self.router = Router()
        self.router.add("GET", "/", self.page)
        self.router.add("GET", "/healthz", self.healthz)
        self.router.add("GET", "/readyz", self.readyz)
        client_api = self._needs_policy
        self.router.add("GET", "/v1/models", client_api(self.models))
        self.router.add("POST", "/v1/chat/completions", client_api(self.chat))
        self.router.add("POST", "/v1/completions", client_api(self.completions))
        self.router.add("POST", "/v1/messages", anthropic_errors(client_api(self.messages)))
        self.router.add("POST", "/v1/embeddings", client_api(self.embeddings))
        for kind in ("chat/completions", "completions"):
            self.router.add("GET", f"/v1/{kind}/{{request_id}}/events", client_api(self.resume))
            self.router.add("POST", f"/v1/{kind}/{{request_id}}/cancel",
                            client_api(self.cancel_stream))

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
        self.awaiting_policy = False
        self.dispatcher.policy = policy
        self._configure_streams(policy)
        if self.cache is not None:
            self.cache.apply_policy(policy)
        self.scheduler.apply_policy(policy)

    def _configure_streams(self, policy: Policy) -> None:
        settings = policy.streams
        self.streams.configure(max_streams=settings.max_streams,
                               max_total_bytes=settings.max_total_bytes,
                               retain_s=settings.retain_ms / 1000)

    # -- plain routes ---------------------------------------------------

    async def page(self, request: Request) -> None:
        await send_text(request.send, 200, CHAT_PAGE, b"text/html; charset=utf-8",
                        [(b"content-security-policy", CHAT_PAGE_CSP.encode())])

    async def healthz(self, request: Request) -> None:
        await send_json(request.send, 200, {"status": "ok"})

    async def readyz(self, request: Request) -> None:
        live = [w for w in self.directory.value.workers if not w.load.draining]
        ready = bool(live) and not self.drain.draining and not self.awaiting_policy
        body = {"ready": ready, "workers": len(live),
                "models": [] if self.awaiting_policy else list(self._models()),
                "draining": self.drain.draining, "policy": not self.awaiting_policy}
        await send_json(request.send, 200 if ready else 503, body)

    async def render_metrics(self) -> bytes:
        """The Prometheus text the admin listener serves at ``/metrics``."""
        return self.metrics.render(self.scheduler.stats(), self.directory.value)

    def _needs_policy(self, handler: Handler) -> Handler:
        async def client_api(request: Request) -> None:
            if self.awaiting_policy:
                raise PolicyUnavailable(
                    "this gateway has no policy from the control plane yet; retry shortly",
                    retry_after=POLICY_RETRY_AFTER_S)
            await handler(request)

        return client_api

    async def models(self, request: Request) -> None:
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": 0, "owned_by": "hedgerow"}
            for name in self._models()]
        # ``kind`` (not OpenAI's) lets a chat client such as the page skip them.
        embedding = [embeddings_api.MODEL] if self.embedding is not None else []
        embedding += [m for m in self.directory.value.embedding_models() if m not in embedding]
        data += [{"id": name, "object": "model", "created": 0, "owned_by": "hedgerow",
                  "kind": "embedding"} for name in embedding]
        await send_json(request.send, 200, {"object": "list", "data": data})

    def _models(self) -> tuple[str, ...]:
        declared = {m.name for m in self.policy.models}
        return tuple(sorted(declared | set(self.directory.value.models())))

    # -- embeddings -----------------------------------------------------

    async def embeddings(self, request: Request) -> None:
        observed = self.metrics.request(time.monotonic())
        observed.operation = "embeddings"
        try:
            await self._embed(request, observed)
        except BaseException as error:
            observed.failed(error)
            raise
        finally:
            observed.finished(time.monotonic())
            self.access_log.write(observed, request.scope)

    async def _embed(self, request: Request, observed: RequestMetrics) -> None:
        """Admitted like a completion (tenant, body limits, requests/s), then
        answered by the cache's embedder (``gateway.corridor.embeddings``)."""
        if self.drain.draining:
            raise GatewayDraining("this gateway is shutting down; retry", retry_after=1)
        policy = self.policy
        identity = self.keys.identify(policy, request.header("authorization"))
        observed.identified(identity.tenant, identity.priority_class, policy_prices(policy))
        _require_json(request)
        body = await request.body(policy.limits.max_body_bytes,
                                  deadline_s=policy.timeouts.body_ms / 1000,
                                  budget=self.body_budget)
        request_json = oa.decode_request(body)
        parsed = embeddings_api.parse(request_json)
        model = self.embedding
        if parsed.model not in embeddings_api.MODEL_ALIASES:
            await self._embed_elsewhere(request, observed, identity, policy, request_json)
            return
        if model is None:
            raise ModelNotFound(f"the embedding model {parsed.model!r} does not exist",
                                param="model")
        observed.labelled(embeddings_api.MODEL, identity.priority_class)
        check_model_allowed(identity.key, embeddings_api.MODEL)
        texts = parsed.texts()
        counts = await model.token_counts(texts)
        embeddings_api.check_token_counts(counts)
        refusal = await self.scheduler.charge_request(identity.tenant, policy)
        if refusal is not None:
            raise refusal.to_error()
        with self.drain.track() as in_flight:
            request.send = in_flight.watch(request.send)
            vectors = await model.embed(texts)
            answer = embeddings_api.response_body(vectors, parsed.encoding_format, sum(counts))
            observed.responded(200)
            await send_json(request.send, 200, answer, [
                (b"x-request-id", request.scope["hedgerow.request_id"].encode())])
            return
        await _end_cut_request(request, in_flight)

    async def _embed_elsewhere(self, request: Request, observed: RequestMetrics,
                               identity: Identity, policy: Policy,
                               request_json: dict[str, Any]) -> None:
        """A model a worker or upstream offers for embeddings (``gateway.corridor.embed_route``):
        the same admission, then forwarded, retried on another if one fails."""
        requested = str(request_json["model"])
        model = policy.canonical_model(requested)
        workers = embed_route.candidates(self.directory.value, model)
        if not workers:
            raise ModelNotFound(f"the embedding model {requested!r} does not exist",
                                param="model")
        observed.labelled(model, identity.priority_class)
        check_model_allowed(identity.key, model)
        refusal = await self.scheduler.charge_request(identity.tenant, policy)
        if refusal is not None:
            raise refusal.to_error()
        request_id = request.scope["hedgerow.request_id"]
        tries = workers[:1 + policy.retries.before_first_token]
        with self.drain.track() as in_flight:
            request.send = in_flight.watch(request.send)
            answer = await embed_route.forward(
                self.dispatcher.workers, tries,
                embed_route.upstream_call(request_id, request_json, model), requested,
                policy.timeouts.ttft_ms / 1000)
            observed.served_by(answer.worker_id, False)
            observed.used(answer.prompt_tokens, 0)
            observed.responded(200)
            await send_json(request.send, 200, answer.body, [
                (b"x-request-id", request_id.encode()),
                (b"x-hedgerow-worker", answer.worker_id.encode())])
            return
        await _end_cut_request(request, in_flight)

    # -- completions ----------------------------------------------------

    async def chat(self, request: Request) -> None:
        await self._complete(request, OPENAI_CHAT)

    async def completions(self, request: Request) -> None:
        await self._complete(request, OPENAI_COMPLETIONS)

    async def messages(self, request: Request) -> None:
        """Anthropic's Messages API: the chat path, its request translated on the
        way in and its answer on the way out (``gateway.corridor.dialects``)."""
        request.send = AnthropicSend(request)
        await self._complete(request, ANTHROPIC_MESSAGES)

    async def _complete(self, request: Request, dialect: Dialect) -> None:
        observed = self.metrics.request(time.monotonic())
        observed.operation = ("chat" if dialect.shape is oa.ChatCompletionRequest
                              else "text_completion")
        with tracing.server_span(observed.operation, request.scope["headers"],
                                 request_attributes(request.scope, observed.operation)) as span:
            try:
                if not await self._complete_observed(request, dialect, observed):
                    observed.responded(CLIENT_CLOSED)
            except BaseException as error:
                observed.failed(error)
                raise
            finally:
                await self.keys.settle(request.scope["hedgerow.request_id"], observed.usage)
                observed.finished(time.monotonic())
                self.access_log.write(observed, request.scope)
                if span.is_recording():
                    describe_request(span, observed)

    async def _complete_observed(self, request: Request, dialect: Dialect,
                                 observed: RequestMetrics) -> bool:
        """Serve one completion; False when the client left before it was done."""
        if self.drain.draining:
            raise GatewayDraining("this gateway is shutting down; retry", retry_after=1)
        # The policy in force when the request arrived governs it to the end,
        # even if a new version is swapped in meanwhile.
        policy = self.policy
        identity = self.keys.identify(policy, dialect.credential(request))
        observed.identified(identity.tenant, identity.priority_class, policy_prices(policy))
        _require_json(request)
        body = await request.body(policy.limits.max_body_bytes,
                                  deadline_s=policy.timeouts.body_ms / 1000,
                                  budget=self.body_budget)
        # Decoded once (and translated to OpenAI's shape): validation, cache, upstream.
        request_json = dialect.decode(request, body)
        parsed = oa.validate_request(request_json, dialect.shape)
        check_request_limits(policy, identity.priority_class,
                             message_chars=parsed.message_chars(),
                             token_limit=parsed.token_limit(),
                             chat=isinstance(parsed, oa.ChatCompletionRequest))
        model = policy.canonical_model(parsed.model)
        self._ensure_model_known(policy, model)
        observed.labelled(model, identity.priority_class)
        await self.keys.admit(request.scope["hedgerow.request_id"], identity, policy, model,
                              estimate_prompt_tokens(parsed),
                              parsed.token_limit() or DEFAULT_OUTPUT_ESTIMATE)
        arrived = time.monotonic()
        # A bad deadline header is refused even when the cache could answer.
        klass = policy.priority_class(identity.priority_class)
        deadline_ms, due_ms = _deadlines(klass, request.header("x-hedgerow-deadline-ms"))
        asked = Asked(request.scope["hedgerow.request_id"], identity.tenant, model, policy,
                      parsed, observed)
        with self.drain.track() as in_flight:
            request.send = in_flight.watch(request.send)
            caching = await self._cache_lookup(request, asked, request_json)
            if caching is not None:
                # Before a flight can be joined: the leader is charged before its joiners.
                await self._charge_request_rate(asked)
            if isinstance(caching, Hit):
                await self._replay(request, asked, caching)
                return True
            # A miss: only now is the work for a worker prepared.
            ticket = self._ticket(asked, identity, klass, arrived, deadline_ms, due_ms)
            ticket.request_charged = caching is not None
            call = UpstreamCall(ticket.request_id, dialect.upstream_path,
                                _upstream_body(request_json, model), model)
            chat = isinstance(parsed, oa.ChatCompletionRequest)
            wanted = Wanted(ticket, call, parsed, chat, observed)
            flight = self._flights.get(caching.key) if caching is not None else None
            if flight is not None and flight.joinable():
                end_with_draining(flight.stream, in_flight)
                return await self._join(request, wanted, flight)
            return await self._lead(request, wanted, caching, in_flight)
        await _end_cut_request(request, in_flight)
        return True

    async def _charge_request_rate(self, asked: Asked) -> None:
        """A cacheable request is charged to the tenant's requests/s (local and
        shared) here, before the cache answers it or it joins or leads a
        flight: cache hits and joins count like any request (a 429 past the
        rate), and a leader is charged before anyone can join it. Its ``submit``
        then skips the requests/s it has paid; tokens, concurrency and the
        queue are charged there as before."""
        refusal = await self.scheduler.charge_request(asked.tenant, asked.policy)
        if refusal is not None:
            raise refusal.to_error()

    def _ticket(self, asked: Asked, identity: Identity, klass: PriorityClass, now: float,
                deadline_ms: int, due_ms: int) -> Ticket:
        policy, parsed, model = asked.policy, asked.parsed, asked.model
        prompt_tokens = estimate_prompt_tokens(parsed)
        route = RouteRequest(
            prompt_tokens=prompt_tokens,
            prefix_key=prefix_key(model, parsed),
            prefer_gpu_above_tokens=policy.routing.prefer_gpu_above_tokens,
            allow_cpu_fallback=policy.routing.allow_cpu_fallback,
            tier=klass.tier,
        )
        return Ticket(
            request_id=asked.request_id, tenant=identity.tenant,
            model=model, arrival=now, due=now + due_ms / 1000, deadline=now + deadline_ms / 1000,
            estimated_tokens=prompt_tokens + (parsed.token_limit() or DEFAULT_OUTPUT_ESTIMATE)
            * parsed.n,
            # Only idempotent requests race on two workers.
            route=route, hedgeable=klass.hedge and not parsed.store, policy=policy)

    # -- the response cache ----------------------------------------------

    async def _cache_lookup(self, request: Request, asked: Asked,
                            request_json: dict[str, Any]) -> Hit | Caching | None:
        """A cached answer; else how to share and store this one (None: not cacheable)."""
        cache = self.cache
        if cache is None:
            return None
        headers = request.scope["headers"]
        if not cacheable(asked.tenant, request_json, asked.policy):
            self.metrics.cache_lookup("uncacheable")
            return None
        with tracing.span("cache lookup") as span:
            hit = await cache.lookup(asked.tenant, asked.model, request_json, headers)
            if hit is not None:
                self.metrics.cache_lookup(hit.kind)
                span.set_attribute("hedgerow.cache.result", hit.kind)
                return hit
            bypass = bypasses_lookup({"cache-control": request.header("cache-control") or ""})
            self.metrics.cache_lookup("bypass" if bypass else "miss")
            span.set_attribute("hedgerow.cache.result", "bypass" if bypass else "miss")
        key = cache.keys(asked.tenant, asked.model, request_json).exact
        # A client that asked for a fresh answer never joins someone else's.
        return Caching(key, request_json, headers, share=not bypass)

    async def _replay(self, request: Request, asked: Asked, hit: Hit) -> None:
        """Answer from the cache: the same SSE events (with ids) or JSON body as live."""
        parsed, request_id = asked.parsed, asked.request_id
        asked.observed.responded(200)
        asked.observed.used(hit.entry.prompt_tokens, hit.entry.completion_tokens,
                            cached=hit.kind)
        if not parsed.stream:
            body = orjson.dumps(hit.json(request_id, model=parsed.model))
            await send_bytes(request.send, 200, body, _answer_headers(
                request_id, None, hit.kind.encode(), hedged=False))
            return
        settings = asked.policy.streams
        stream = StreamLog(request_id, asked.tenant, settings.max_buffer_bytes,
                           include_usage=parsed.include_usage())
        now = time.monotonic()
        parser, seen = SseParser(), RelayOutcome()
        for raw in hit.sse(request_id, model=parsed.model,
                           include_usage=parsed.include_usage()):
            for event in parser.feed(raw):
                stream.append(classify(event, seen), event.raw, now)
        stream.open("", hedged=False)
        stream.finish(now)
        self.streams.add(stream, now)
        with stream.reading():
            await cancel_on_disconnect(request, lambda: self._answer_stream(
                request, stream, 0, asked.observed, cache=hit.kind.encode()))

    # -- a generation writes a log; clients follow it ---------------------

    async def _lead(self, request: Request, wanted: Wanted, caching: Caching | None,
                    in_flight: InFlight) -> bool:
        """Generate the answer, sharing it with identical requests that arrive
        meanwhile and storing it in the cache; False when the client left first.

        The generation runs beside the client's reader. When a streaming
        client goes away it runs on for the policy's resume grace, so the
        client can come back with ``Last-Event-ID``; a client that leaves
        before the first token (it never learnt the stream's id) stops it at
        once, unless others share it.
        """
        ticket, parsed = wanted.ticket, wanted.parsed
        settings = (ticket.policy or self.policy).streams
        stream = StreamLog(ticket.request_id, ticket.tenant, settings.max_buffer_bytes,
                           include_usage=parsed.include_usage())
        flight = Flight(stream)
        end_with_draining(stream, in_flight)
        if parsed.stream:
            self.streams.add(stream, time.monotonic())
        if caching is not None and caching.share:
            self._flights[caching.key] = flight
        generation = Generation(self.scheduler, self.dispatcher, stream, ticket, wanted.call,
                                keep_text=caching is not None or not parsed.stream)
        generating = anyio.CancelScope()
        grace_s = settings.resume_grace_ms / 1000 if parsed.stream else 0.0

        async def generate() -> None:
            try:
                with generating:
                    flight.outcome = await generation.run(wanted.observed)
                _note_usage(wanted.observed, flight.outcome)
            finally:
                flight.done.set()
                if caching is not None and self._flights.get(caching.key) is flight:
                    del self._flights[caching.key]
            if caching is not None:
                await self._cache_store(caching, wanted, flight.outcome)

        async def stop_when_abandoned() -> None:
            if await stream.abandoned(grace_s):
                generating.cancel()

        completed = False
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            with stream.reading():
                tg.start_soon(generate)
                tg.start_soon(stop_when_abandoned)
                try:
                    completed = await cancel_on_disconnect(
                        request, lambda: self._answer(request, wanted, flight))
                except Exception as caught:  # re-raised as itself, outside the group
                    error = caught
        if error is not None:
            raise error
        return completed

    async def _join(self, request: Request, wanted: Wanted, flight: Flight) -> bool:
        """An identical request is being generated: follow it instead of generating again."""
        self.metrics.single_flight_joined()
        if wanted.parsed.stream:
            self.streams.alias(wanted.ticket.request_id, wanted.ticket.tenant, flight.stream,
                               time.monotonic())
        with flight.stream.reading():
            answered = await cancel_on_disconnect(
                request, lambda: self._answer(request, wanted, flight))
        # The leader's usage, once its generation has ended (it ends with the stream).
        with anyio.move_on_after(JOIN_USAGE_WAIT_S):
            await flight.done.wait()
        _note_usage(wanted.observed, flight.outcome, cached="joined")
        return answered

    async def _answer(self, request: Request, wanted: Wanted, flight: Flight) -> None:
        if wanted.parsed.stream:
            await self._answer_stream(request, flight.stream, 0, wanted.observed,
                                      include_usage=wanted.parsed.include_usage(),
                                      request_id=wanted.ticket.request_id)
        else:
            await self._answer_whole(request, wanted, flight)

    async def _cache_store(self, caching: Caching, wanted: Wanted,
                           outcome: RelayOutcome | None) -> None:
        if self.cache is None or outcome is None or outcome.failed or not outcome.complete:
            return
        ticket = wanted.ticket
        entry = entry_from_fold(outcome.fold, outcome.finish_reason, outcome.prompt_tokens,
                                outcome.completion_tokens, ticket.model, oa.now_created())
        if entry is None:  # an answer the cache could not give back exactly
            return
        with anyio.CancelScope(shield=True):
            await self.cache.store(ticket.tenant, ticket.model, caching.request_json, entry,
                                   caching.headers)

    async def _answer_stream(self, request: Request, stream: StreamLog, after: int,
                             observed: RequestMetrics | None, *, cache: bytes = b"miss",
                             include_usage: bool | None = None,
                             request_id: str | None = None) -> None:
        """Start the SSE response once the stream has its first token, then follow it."""
        await stream.wait_open()
        request_id = request_id or stream.request_id
        if stream.refusal is not None:
            raise stream.refusal.error
        if not stream.started:
            raise UpstreamFailed("the generation stopped before its first token",
                                 code="stream_cancelled")
        if observed is not None:
            observed.responded(200)
            observed.served_by(stream.worker_id, stream.hedged)
            if stream.hedged and request_id == stream.request_id:
                self.metrics.hedge_won()
        headers = _answer_headers(request_id, stream.worker_id, cache, stream.hedged)
        await request.send({"type": "http.response.start", "status": 200,
                            "headers": list(SSE_HEADERS) + headers})
        settings = self.policy.streams
        try:
            await follow_log(request, stream, after=after,
                             include_usage=(stream.include_usage if include_usage is None
                                            else include_usage),
                             heartbeat_s=settings.heartbeat_ms / 1000,
                             stall_s=settings.write_stall_ms / 1000, observer=observed)
        except ClientStalled as stalled:
            log.warning("cut a stalled client of %s: %s", stream.request_id, stalled)

    async def _answer_whole(self, request: Request, wanted: Wanted, flight: Flight) -> None:
        """A non-streaming client: the generation folded into one JSON body."""
        await flight.done.wait()
        stream, outcome, ticket = flight.stream, flight.outcome, wanted.ticket
        if stream.refusal is not None:
            raise stream.refusal.error
        if outcome is None or outcome.failed or not outcome.complete:
            # The generation logged the worker's detail; the client gets the public message.
            raise UpstreamFailed("the generation failed after its first token",
                                 code=(outcome.error_code if outcome else "") or "upstream_error")
        if stream.hedged and ticket.request_id == stream.request_id:
            self.metrics.hedge_won()
        body = completion_body(ticket.request_id, ticket.model, outcome, wanted.chat)
        wanted.observed.responded(200)
        wanted.observed.served_by(stream.worker_id, stream.hedged)
        await send_bytes(request.send, 200, body, _answer_headers(
            ticket.request_id, stream.worker_id, b"miss", stream.hedged))

    async def resume(self, request: Request) -> None:
        """``GET …/{request_id}/events`` with ``Last-Event-ID``: the events after it, then live."""
        identity = self.keys.identify(self.policy, request.header("authorization"))
        stream = self.streams.find(request.path_params["request_id"], identity.tenant,
                                   time.monotonic())
        after = _last_event_id(request)
        if after > stream.last_id and stream.finished:
            raise InvalidRequest(f"Last-Event-ID {after} is past the stream's last event "
                                 f"({stream.last_id})", param="Last-Event-ID")
        if not stream.holds_after(min(after, stream.last_id)):
            raise StreamGone(f"the events after {after} of stream {stream.request_id!r} "
                             "are no longer kept")
        with self.drain.track() as in_flight:
            request.send = in_flight.watch(request.send)
            end_with_draining(stream, in_flight)
            with stream.reading():
                await cancel_on_disconnect(
                    request, lambda: self._answer_stream(request, stream, after, None))
            return
        await _end_cut_request(request, in_flight)

    async def cancel_stream(self, request: Request) -> None:
        """``POST …/{request_id}/cancel``: stop the generation now, for every reader."""
        identity = self.keys.identify(self.policy, request.header("authorization"))
        stream = self.streams.find(request.path_params["request_id"], identity.tenant,
                                   time.monotonic())
        running = not stream.finished
        stream.cancel("the stream was cancelled by the client")
        await send_json(request.send, 200, {"id": stream.request_id, "object": "stream.cancel",
                                            "cancelled": running})

    def _ensure_model_known(self, policy: Policy, model: str) -> None:
        if policy.declares_model(model) or model in self.directory.value.models():
            return
        raise ModelNotFound(f"the model {model!r} does not exist", param="model")


# A joiner's answer is complete when the shared stream is; the leader's usage
# follows at once, but a log line is never held back longer than this for it.
JOIN_USAGE_WAIT_S = 1.0


def _note_usage(observed: RequestMetrics, outcome: RelayOutcome | None,
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
    request_json: dict[str, Any]
    headers: Headers
    share: bool  # identical requests arriving meanwhile may join its generation


@dataclass(eq=False)
class Flight:
    """One generation, shared by identical requests (single-flight)."""

    stream: StreamLog
    outcome: RelayOutcome | None = None
    done: anyio.Event = field(default_factory=anyio.Event)

    def joinable(self) -> bool:
        """Joining replays it from its first event, so all of them must still be kept."""
        return not self.done.is_set() and self.stream.holds_after(0)


def _answer_headers(request_id: str, worker_id: str | None, cache: bytes,
                    hedged: bool) -> Headers:
    headers: Headers = [(b"x-request-id", request_id.encode()), (b"x-hedgerow-cache", cache),
                        (b"x-hedgerow-hedged", b"1" if hedged else b"0")]
    if worker_id:
        headers.append((b"x-hedgerow-worker", worker_id.encode()))
    return headers


DEFAULT_OUTPUT_ESTIMATE = 256


def estimate_prompt_tokens(parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> int:
    """About four characters a token: good enough to admit and route by."""
    if isinstance(parsed, oa.ChatCompletionRequest):
        chars = sum(len(m.text()) + 8 for m in parsed.messages)
    else:
        chars = len(parsed.prompt)
    return max(1, chars // 4)


def prefix_key(model: str, parsed: oa.ChatCompletionRequest | oa.CompletionRequest) -> str | None:
    """The conversation's key for prompt-cache affinity: the same for every turn,
    so each next turn goes to the worker holding the conversation's KV cache."""
    if not isinstance(parsed, oa.ChatCompletionRequest):
        return None
    return conversation_key(model, [(m.role, m.text()) for m in parsed.messages])


def _deadlines(klass: PriorityClass, header: str | None) -> tuple[int, int]:
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


def _last_event_id(request: Request) -> int:
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


def _upstream_body(request_json: dict[str, Any], model: str) -> bytes:
    """Workers are always asked to stream, with usage, for the canonical model name.
    (A copy: ``request_json`` is also the cache's key material.)"""
    return orjson.dumps({**request_json, "model": model, "stream": True,
                         "stream_options": {"include_usage": True}})


def _drain_cut_error() -> GatewayDraining:
    return GatewayDraining("the gateway shut down before the response was complete",
                           retry_after=1)


def end_with_draining(stream: StreamLog, in_flight: InFlight) -> None:
    """If the drain deadline cuts this request, ``stream`` ends with
    ``gateway_draining``: set before anything is cancelled, so whichever ends
    first -- the generation writing the stream's last event, or
    ``_end_cut_request`` -- the client reads the same error."""
    def note() -> None:
        draining = _drain_cut_error()
        stream.cancel(draining.message, code=draining.code, error_type=draining.error_type)

    in_flight.before_cut.append(note)


async def _end_cut_request(request: Request, in_flight: InFlight) -> None:
    """The drain deadline cut this request: end it explicitly, never silently."""
    draining = _drain_cut_error()
    if not in_flight.response_started:
        raise draining
    if in_flight.response_finished:
        return
    event = oa.error_event(draining.message, draining.error_type, draining.code)
    await request.send({"type": "http.response.body", "body": sse_event(event),
                        "more_body": True})
    await request.send({"type": "http.response.body", "body": b""})


def _require_json(request: Request) -> None:
    content_type = (request.header("content-type") or "application/json").lower()
    if "json" not in content_type:
        raise UnsupportedMediaType(f"content-type must be application/json, not {content_type!r}")
