"""HTTP API of the control plane: worker register / heartbeat / deregister,
worker list, and the watch stream gateways follow; and the operators' admin
API (status, policy, upstreams) with ``/metrics`` beside it, which
``admin_listener`` moves off this listener onto one of its own
(``serve_admin``): then this one answers those routes 404, as any unknown
path."""

from __future__ import annotations

import time

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from control_plane.admin_auth import AdminGuard, CallerCheck, ControlPlaneRoutes
from control_plane.bodies import parse_body
from control_plane.key_api import KeyApi
from control_plane.metrics import ControlPlaneMetrics
from control_plane.policy_api import PolicyApi
from control_plane.registry_actor import Beat, Deregister, Register, Snapshot
from control_plane.trust_api import TrustApi
from control_plane.trust_service import ANY_ROLE, TrustService
from control_plane.upstream_api import UpstreamApi
from hedgerow.actors import ActorRef
from hedgerow.asgi import (
    SSE_HEADERS,
    Receive,
    Request,
    Router,
    Scope,
    Send,
    send_bytes,
    send_json,
    sse_of_latest,
    stream_until_disconnect,
)
from hedgerow.decimal_text import parse_decimal
from hedgerow.errors import Conflict, InvalidRequest, PermissionDenied, UnknownWorker
from hedgerow.latest import LatestValue
from hedgerow.metrics import CONTENT_TYPE
from hedgerow.trust.identity import Identity
from hedgerow.trust.peer import PEER, Peer
from hedgerow.wire import Heartbeat, RegisterReply, RegistrySnapshot, SelfRegistration

MAX_BODY = 64 * 1024
ASK_TIMEOUT_S = 5.0
WATCH_KEEPALIVE_S = 15.0
REVOCATION_CHECK_S = 1.0



@dataclass
class ControlPlaneApp:
    registry: ActorRef
    published: LatestValue[RegistrySnapshot]
    lease_s: float
    heartbeat_interval_s: float
    metrics: ControlPlaneMetrics
    policy_api: PolicyApi | None = None  # /v1/policy…: operator policy versions
    upstream_api: UpstreamApi | None = None  # /v1/upstreams…: probed external servers
    guard: AdminGuard = field(default_factory=lambda: AdminGuard(None))  # admin token
    # True: the admin routes are served by ``serve_admin`` only (``--admin-port``).
    admin_listener: bool = False
    # Who may call what (certificate identities); None: --insecure-internal.
    trust: TrustService | None = None

    def __post_init__(self) -> None:
        self.router = Router()
        self.admin_router = Router() if self.admin_listener else self.router
        routes = ControlPlaneRoutes(self.router, self.admin_router, self.guard,
                                    CallerCheck(self.trust))
        routes.internal("GET", "/healthz", self.healthz, roles=ANY_ROLE)
        routes.metrics("GET", "/metrics", self.prometheus)
        routes.internal("GET", "/v1/workers", self.list_workers, roles=("gateway", "admin"))
        routes.internal("POST", "/v1/workers", self.register, roles=("worker",))
        routes.internal("POST", "/v1/workers/{worker_id}/heartbeat", self.heartbeat,
                        roles=("worker",))
        routes.internal("DELETE", "/v1/workers/{worker_id}", self.deregister,
                        roles=("worker", "admin"))
        routes.internal("GET", "/v1/watch", self.watch, roles=("gateway", "admin"))
        routes.admin("GET", "/v1/status", self.status)
        if self.trust is not None:
            if self.policy_api is not None:
                self.policy_api.is_revoked = self.trust.revoked
            self.trust_api: TrustApi | None = TrustApi(self.trust, self.evict)
            self.trust_api.add_routes(routes)
        else:
            self.trust_api = None
        if self.admin_listener:  # a probe for the admin listener itself, token-free
            self.admin_router.add("GET", "/healthz", self.healthz)
        if self.policy_api is not None:
            self.policy_api.add_routes(routes)
            # Virtual keys are policy versions; their secret comes from the CA.
            root = self.trust.book_mac_key() if self.trust is not None else None
            KeyApi(self.policy_api.policies, root).add_routes(routes)
        if self.upstream_api is not None:
            self.upstream_api.add_routes(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.router.serve(scope, receive, send)

    async def serve_admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of the admin listener (only with ``admin_listener``)."""
        await self.admin_router.serve(scope, receive, send)

    async def healthz(self, request: Request) -> None:
        await send_json(request.send, 200, {"status": "ok"})

    async def prometheus(self, request: Request) -> None:
        await send_bytes(request.send, 200, self.metrics.render(), content_type=CONTENT_TYPE)

    async def status(self, request: Request) -> None:
        """Every worker and gateway, and the policy version each gateway runs."""
        snapshot = await self.registry.ask(Snapshot(), timeout=ASK_TIMEOUT_S)
        body: dict[str, Any] = {"workers": [
            {"worker_id": w.registration.worker_id, "kind": w.registration.kind,
             "device": w.registration.device,
             "device_memory_bytes": w.registration.device_memory_bytes,
             "models": list(w.registration.models),
             "embedding_models": list(w.registration.embedding_models),
             "slots": w.registration.slots, "active": w.load.active, "draining": w.load.draining,
             "labels": w.registration.labels, "external": w.registration.external}
            for w in snapshot.workers]}
        if self.policy_api is not None:
            current = self.policy_api.published.value
            body["policy"] = {"version": current.version, "checksum": current.checksum}
            body["gateways"] = self.policy_api.gateways.rows(time.monotonic())
        await send_json(request.send, 200, body)

    async def list_workers(self, request: Request) -> None:
        snapshot = await self.registry.ask(Snapshot(), timeout=ASK_TIMEOUT_S)
        await send_json(request.send, 200, snapshot.model_dump(mode="json"))

    def _own_worker(self, worker_id: str) -> None:
        """A worker acts only under its certificate's name (admins on any)."""
        if self.trust is None:
            return
        peer = PEER.get()
        assert peer is not None  # the route's role check passed
        if peer.identity.role == "worker" and peer.identity.name != worker_id:
            raise PermissionDenied(f"{peer.identity} may act only as worker "
                                   f"{peer.identity.name!r}, not {worker_id!r}",
                                   code="identity_mismatch")

    async def evict(self, identity: Identity) -> None:
        """A revoked worker leaves the registry at once (its heartbeats are refused)."""
        if identity.role == "worker":
            try:
                await self.registry.ask(Deregister(identity.name), timeout=ASK_TIMEOUT_S)
            except UnknownWorker:
                pass  # not registered now: revoked all the same

    def _not_an_upstream(self, worker_id: str) -> None:
        """A worker may not take the name of an external upstream (and its traffic)."""
        for record in self.published.value.workers:
            if record.registration.worker_id == worker_id and record.registration.external:
                raise Conflict(f"{worker_id!r} is an external upstream's name",
                               code="name_taken")

    async def register(self, request: Request) -> None:
        registration = await parse_body(request, SelfRegistration, "worker registration")
        self._own_worker(registration.worker_id)
        self._not_an_upstream(registration.worker_id)
        if self.trust is not None and not registration.url.startswith("https://"):
            raise InvalidRequest("a worker's url must be https:// (gateways call workers "
                                 "over mutual TLS)", code="invalid_worker_url")
        await self.registry.ask(Register(registration.record()), timeout=ASK_TIMEOUT_S)
        reply = RegisterReply(
            worker_id=registration.worker_id,
            lease_s=self.lease_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        await send_json(request.send, 201, reply.model_dump(mode="json"))

    async def heartbeat(self, request: Request) -> None:
        beat = await parse_body(request, Heartbeat, "heartbeat")
        worker_id = request.path_params["worker_id"]
        self._own_worker(worker_id)
        self._not_an_upstream(worker_id)
        await self.registry.ask(Beat(worker_id, beat.load), timeout=ASK_TIMEOUT_S)
        reply: dict[str, Any] = {"worker_id": worker_id, "lease_s": self.lease_s}
        if self.trust is not None:
            # Workers learn of revoked gateways here, within a heartbeat.
            reply["revoked"] = self.trust.revoked_callers()
        await send_json(request.send, 200, reply)

    async def deregister(self, request: Request) -> None:
        worker_id = request.path_params["worker_id"]
        self._own_worker(worker_id)
        self._not_an_upstream(worker_id)
        await self.registry.ask(Deregister(worker_id), timeout=ASK_TIMEOUT_S)
        await send_json(request.send, 200, {"worker_id": worker_id, "deregistered": True})

    async def watch(self, request: Request) -> None:
        """SSE stream of whole registry snapshots, newest only, one per version."""
        since = request.query().get("since", "-1")
        # Anything but a version number (e.g. the default -1) means "none known".
        parsed = parse_decimal(since)
        known = -1 if parsed is None else parsed
        # A watcher that holds exactly the current version waits for the next;
        # anyone else (new, behind, or ahead of a restarted plane) gets it now.
        start = known if known == self.published.version else -1
        with self.metrics.watchers.track_inprogress():
            await stream_until_disconnect(request, 200, list(SSE_HEADERS),
                                          self._snapshots(start, PEER.get()))

    def _snapshots(self, version: int, peer: Peer | None) -> AsyncGenerator[bytes, None]:
        trust = self.trust
        return sse_of_latest(
            self.published, version, lambda snapshot: snapshot.model_dump(mode="json"),
            keepalive_s=WATCH_KEEPALIVE_S, check_s=REVOCATION_CHECK_S,
            still_allowed=lambda: trust is None or not trust.revoked(peer))
