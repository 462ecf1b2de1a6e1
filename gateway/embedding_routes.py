"""``/v1/embeddings``: admitted like a completion, answered by the cache's embedder
or forwarded to a worker or upstream that offers the model (``gateway.corridor.embed_route``).

Charged like a completion too (``gateway.corridor.key_gate``): before the work,
the input tokens are reserved on every tenant and key budget (and the key's
tokens/min), the model's input price pricing them; when the request ends, the
reservation is replaced by the ``usage.prompt_tokens`` of the answer (nothing
when it failed). A spent budget is a 429 ``budget_exceeded`` as on chat. The
tenant's requests/s and tokens/min (shared through Redis, then this gateway's)
take the same input tokens and are settled the same way: a 429
``requests_rate`` / ``tokens_rate`` as on chat, so embeddings are no way
around a tenant's token rate.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from gateway.corridor import embed_route
from gateway.corridor.key_gate import SETTLE_TIMEOUT_S
from gateway.app_state import AppState
from gateway.admin.metrics import RequestMetrics
from gateway.request_terms import end_cut_request, require_json, tokens_in
from gateway.admin.usage_metrics import policy_prices
from hedgerow import embeddings_api, openai_api as oa
from hedgerow.asgi import Request, send_json
from hedgerow.errors import GatewayDraining, ModelNotFound
from policies.keys import check_model_allowed
from policies.schema import Policy
from policies.tenancy import Identity


log = logging.getLogger("hedgerow.gateway.embeddings")

class EmbeddingRoutes(AppState):
    """``/v1/embeddings``."""

    async def embeddings(self, request: Request) -> None:
        observed = self.metrics.request(time.monotonic())
        observed.operation = "embeddings"
        try:
            await self._embed(request, observed)
        except BaseException as error:
            observed.failed(error)
            raise
        finally:
            await self.keys.settle(request.scope["hedgerow.request_id"], observed.usage)
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
        require_json(request)
        body = await request.body(policy.limits.max_body_bytes,
                                  deadline_s=policy.timeouts.body_ms / 1000,
                                  budget=self.body_budget)
        request_json = oa.decode_request(body)
        parsed = embeddings_api.parse(request_json)
        model = self.embedding
        if parsed.model not in embeddings_api.MODEL_ALIASES:
            await self._embed_elsewhere(request, observed, identity, policy, request_json,
                                        parsed)
            return
        if model is None:
            raise ModelNotFound(f"the embedding model {parsed.model!r} does not exist",
                                param="model")
        if not self.serves_builtin_embedder():
            # Not listed by /v1/models either: a 503 would have the client retry for ever.
            raise ModelNotFound(f"the embedding model {parsed.model!r} is not served by this "
                                "gateway: its policy leaves the semantic cache off "
                                "(cache.semantic.enabled)", param="model")
        observed.labelled(embeddings_api.MODEL, identity.priority_class)
        check_model_allowed(identity.key, embeddings_api.MODEL)
        texts = parsed.texts()
        counts = await model.token_counts(texts)
        embeddings_api.check_token_counts(counts)
        request_id = request.scope["hedgerow.request_id"]
        await self.keys.admit(request_id, identity, policy, embeddings_api.MODEL, sum(counts), 0)
        await self._charge_tenant(identity, policy, request_id, sum(counts))
        used = 0
        try:
            with self.drain.track() as in_flight:
                request.send = in_flight.watch(request.send)
                vectors = await model.embed(texts)
                used = sum(counts)
                answer = embeddings_api.response_body(vectors, parsed.encoding_format, used)
                observed.used(used, 0)
                observed.responded(200)
                await send_json(request.send, 200, answer, [(b"x-request-id", request_id.encode())])
                return
            await end_cut_request(request, in_flight)
        finally:
            await self._settle_tenant(identity, policy, request_id, sum(counts), used)

    async def _charge_tenant(self, identity: Identity, policy: Policy, request_id: str,
                             tokens: int) -> None:
        """The tenant's requests/s and tokens/min (shared, then local), as a chat's
        admission charges them; a 429 when either is spent."""
        refusal = await self.scheduler.charge_request(identity.tenant, policy, tokens,
                                                      request_id)
        if refusal is not None:
            raise refusal.to_error()

    async def _settle_tenant(self, identity: Identity, policy: Policy, request_id: str,
                             estimated: int, actual: int) -> None:
        """The tokens charged at the door corrected by the answer's count (0 for
        a request that failed: all of it goes back); never raises."""
        try:
            with anyio.CancelScope(shield=True), anyio.fail_after(SETTLE_TIMEOUT_S):
                await self.scheduler.settle_request(identity.tenant, policy, request_id,
                                                    estimated, actual)
        except Exception:
            log.exception("request %s: settling the tenant's tokens failed", request_id)

    async def _embed_elsewhere(self, request: Request, observed: RequestMetrics,
                               identity: Identity, policy: Policy,
                               request_json: dict[str, Any],
                               parsed: embeddings_api.EmbeddingsRequest) -> None:
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
        # No tokenizer for a model served elsewhere: about four characters a
        # token reserved now, the answer's own count settled at the end.
        estimate = sum(tokens_in(text) for text in parsed.texts())
        request_id = request.scope["hedgerow.request_id"]
        await self.keys.admit(request_id, identity, policy, model, estimate, 0)
        await self._charge_tenant(identity, policy, request_id, estimate)
        used = 0
        tries = workers[:1 + policy.retries.before_first_token]
        try:
            with self.drain.track() as in_flight:
                request.send = in_flight.watch(request.send)
                answer = await embed_route.forward(
                    self.dispatcher.workers, tries,
                    embed_route.upstream_call(request_id, request_json, model), requested,
                    policy.timeouts.ttft_ms / 1000)
                # An answer without usage is charged what was reserved, not nothing:
                # else an upstream that leaves it out would lift every limit.
                used = answer.prompt_tokens if answer.prompt_tokens is not None else estimate
                observed.served_by(answer.worker_id, False)
                observed.used(used, 0)
                observed.responded(200)
                await send_json(request.send, 200, answer.body, [
                    (b"x-request-id", request_id.encode()),
                    (b"x-hedgerow-worker", answer.worker_id.encode())])
                return
            await end_cut_request(request, in_flight)
        finally:
            await self._settle_tenant(identity, policy, request_id, estimate, used)
