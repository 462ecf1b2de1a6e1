"""A completion request's way in: identify, read, validate, admit, then the cache or a flight.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/messages`` (Anthropic's
shape, translated by ``gateway.corridor.dialects``), and the stream routes: resume with
``Last-Event-ID`` and cancel. The policy in force when a request arrives
governs it to the end.
"""

from __future__ import annotations

import logging
import time

from gateway.corridor.attempt import UpstreamCall
from gateway.cache import Hit
from gateway.cached_answers import CachedAnswers
from gateway.corridor.dialects import (
    ANTHROPIC_MESSAGES,
    AnthropicSend,
    Dialect,
    OPENAI_CHAT,
    OPENAI_COMPLETIONS,
)
from gateway.admin.metrics import CLIENT_CLOSED, RequestMetrics
from gateway.request_terms import (
    Asked,
    DEFAULT_OUTPUT_ESTIMATE,
    Wanted,
    deadlines,
    end_cut_request,
    end_with_draining,
    estimate_prompt_tokens,
    last_event_id,
    prefix_key,
    require_json,
    upstream_body,
)
from gateway.corridor.tickets import Ticket
from gateway.admin.tracing_attributes import describe_request, request_attributes
from gateway.admin.usage_metrics import policy_prices
from hedgerow import openai_api as oa
from hedgerow import tracing
from hedgerow.asgi import Request, cancel_on_disconnect, send_json
from hedgerow.errors import GatewayDraining, InvalidRequest, ModelNotFound, StreamGone
from policies.request_limits import check_request_limits
from policies.schema import Policy, PriorityClass
from policies.scoring import RouteRequest
from policies.tenancy import Identity

log = logging.getLogger("hedgerow.gateway.completions")


class CompletionRoutes(CachedAnswers):
    """The completion routes and the resumable stream routes."""

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
                request_id = request.scope["hedgerow.request_id"]
                try:
                    # Shielded and bounded inside (``KeyGate.settle``): a client that
                    # leaves, or the drain's cut, cannot skip it.
                    await self.keys.settle(request_id, observed.usage)
                except Exception:  # the answer stands; the request is still logged
                    log.exception("request %s: settling its budgets failed", request_id)
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
        require_json(request)
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
        deadline_ms, due_ms = deadlines(klass, request.header("x-hedgerow-deadline-ms"))
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
                                upstream_body(request_json, model), model)
            chat = isinstance(parsed, oa.ChatCompletionRequest)
            wanted = Wanted(ticket, call, parsed, chat, observed)
            flight = self._flights.get(caching.key) if caching is not None else None
            if flight is not None and flight.joinable():
                end_with_draining(flight.stream, in_flight)
                return await self._join(request, wanted, flight)
            return await self._lead(request, wanted, caching, in_flight)
        await end_cut_request(request, in_flight)
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

    async def resume(self, request: Request) -> None:
        """``GET …/{request_id}/events`` with ``Last-Event-ID``: the events after it, then live."""
        identity = self.keys.identify(self.policy, request.header("authorization"))
        stream = self.streams.find(request.path_params["request_id"], identity.tenant,
                                   time.monotonic())
        after = last_event_id(request)
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
        await end_cut_request(request, in_flight)

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
