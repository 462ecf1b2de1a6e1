"""The gateway's OpenAI-compatible API.

Request path: identify the tenant, read the body within the policy's limit,
validate, resolve the model, and build a ``Ticket`` (class deadline, token
estimate, route preferences). The scheduler, called directly through its
door (``gateway.corridor.scheduling``), admits it or refuses it at once (429/503,
never touching a worker), then assigns it a worker slot in deadline order;
the dispatcher gets its first token (retrying or hedging as needed); the relay streams the rest. A client that goes away cancels all of
it, which stops the generation upstream.

This app is the public port: the client API, the chat page, ``/healthz`` and
``/readyz``, nothing else. Metrics (``render_metrics``) are served by the
admin listener (``gateway.admin.api``). Until a policy is in force
(``awaiting_policy``: following the control plane, none received yet) every
client API route answers 503 ``policy_unavailable`` rather than serve under a
built-in default the operator never chose.

The app is split by concern, each piece a mixin over one state
(``gateway.app_state``): this module is the ASGI face, the route table, the
plain routes and the lifecycle (``apply_policy``); ``gateway.completions`` a
completion's way in, ``gateway.cached_answers`` the response cache on it,
``gateway.flights`` a generation and the clients that follow it,
``gateway.embedding_routes`` the embeddings route, and
``gateway.request_terms`` the plain data and pure functions they share.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.admin.access_log import AccessLog
from gateway.cache import ResponseCache
from gateway.completions import CompletionRoutes
from gateway.corridor.dialects import ANTHROPIC_MESSAGES, anthropic_errors
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.drain import Drain
from gateway.embedding_routes import EmbeddingRoutes
from gateway.corridor.embeddings import EmbeddingModel
from gateway.corridor.key_gate import KeyGate
from gateway.admin.metrics import GatewayMetrics
from gateway.edge.page import CHAT_PAGE, CHAT_PAGE_CSP
from gateway.request_terms import Asked, Flight, end_with_draining, prefix_key
from gateway.request_terms import deadlines as _deadlines  # the name tests know
from gateway.corridor.scheduling import SchedulerDoor
from gateway.corridor.stream_log import StreamBook
from hedgerow import embeddings_api
from hedgerow.asgi import Handler, Receive, Request, Router, Scope, Send, send_json, send_text
from hedgerow.body_budget import BodyBudget
from hedgerow.errors import ModelNotFound, PolicyUnavailable
from hedgerow.latest import LatestValue
from hedgerow.logs import request_id_var
from hedgerow.wire import RegistrySnapshot
from policies.schema import Policy


# The policy follower reconnects within 2 s; a client may come back after that.
POLICY_RETRY_AFTER_S = 2.0


@dataclass
class GatewayApp(CompletionRoutes, EmbeddingRoutes):
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
        self.router.add("GET", "/v1/models/{model}", client_api(self.model))
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
        await send_json(request.send, 200, {"object": "list", "data": self._listed(request)})

    async def model(self, request: Request) -> None:
        """``GET /v1/models/{model}``: one entry of the list; a model the list does
        not show (unknown, or outside the presented key's allowlist) is a 404."""
        name = request.path_params["model"]
        found = next((m for m in self._listed(request) if m["id"] == name), None)
        if found is None:
            raise ModelNotFound(f"the model {name!r} does not exist", param="model")
        await send_json(request.send, 200, found)

    def _listed(self, request: Request) -> list[dict[str, Any]]:
        """The models the request's key may use: all of them without a key (the
        chat page lists before any key is typed) or with one that allows every
        model; a virtual key with a model allowlist sees only those. A key that
        is presented must be valid (401 otherwise), like on every other route."""
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": 0, "owned_by": "hedgerow"}
            for name in self._models()]
        # ``kind`` (not OpenAI's) lets a chat client such as the page skip them.
        embedding = [embeddings_api.MODEL] if self.serves_builtin_embedder() else []
        embedding += [m for m in self.directory.value.embedding_models() if m not in embedding]
        data += [{"id": name, "object": "model", "created": 0, "owned_by": "hedgerow",
                  "kind": "embedding"} for name in embedding]
        # Anthropic's SDKs send ``x-api-key``, OpenAI's ``Authorization``: either names the key.
        credential = ANTHROPIC_MESSAGES.credential(request)
        if credential is None or not credential.strip():
            return data
        key = self.keys.identify(self.policy, credential).key
        if key is None or not key.models:
            return data
        return [entry for entry in data if entry["id"] in key.models]

    def _models(self) -> tuple[str, ...]:
        declared = {m.name for m in self.policy.models}
        return tuple(sorted(declared | set(self.directory.value.models())))


__all__ = ["Asked", "GatewayApp", "POLICY_RETRY_AFTER_S", "_deadlines", "end_with_draining",
           "prefix_key"]
