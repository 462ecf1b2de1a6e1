"""The state the gateway's route mixins share: declared once, held by ``GatewayApp``.

The app is split by concern (``gateway.app``: the ASGI face, routes and
lifecycle; ``gateway.completions``: a completion request's way in;
``gateway.cached_answers``: the response cache on that way;
``gateway.flights``: a generation and the clients that follow it;
``gateway.embedding_routes``: ``/v1/embeddings``). Each is a mixin over
this state, so the pieces stay plain methods on one object.
"""

from __future__ import annotations

from gateway.admin.access_log import AccessLog
from gateway.cache import ResponseCache
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.drain import Drain
from gateway.corridor.embeddings import EmbeddingModel
from gateway.corridor.key_gate import KeyGate
from gateway.admin.metrics import GatewayMetrics
from gateway.request_terms import Flight
from gateway.corridor.scheduling import SchedulerDoor
from gateway.corridor.stream_log import StreamBook
from hedgerow.body_budget import BodyBudget
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.schema import Policy


class AppState:
    """The gateway's state, as the route mixins see it (``GatewayApp`` holds it)."""

    policy: Policy
    directory: LatestValue[RegistrySnapshot]
    scheduler: SchedulerDoor
    dispatcher: Dispatcher
    metrics: GatewayMetrics
    drain: Drain
    cache: ResponseCache | None
    awaiting_policy: bool
    body_budget: BodyBudget
    access_log: AccessLog
    keys: KeyGate
    streams: StreamBook
    _flights: dict[str, Flight]
    embedding: EmbeddingModel | None

    def serves_builtin_embedder(self) -> bool:
        """The built-in embedding model is served (listed by ``/v1/models``,
        answered by ``/v1/embeddings``) while it runs or the policy starts it;
        otherwise it does not exist here, not "retry later"."""
        return self.embedding is not None and (self.embedding.ready() or (
            self.cache is not None and self.cache.wants_embedder()))
