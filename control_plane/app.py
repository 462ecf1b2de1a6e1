"""HTTP API of the control plane: worker register / heartbeat / deregister,
worker list, and the watch stream gateways follow; and the operators' admin
API (status, policy, upstreams), which ``admin_listener`` moves off this
listener onto one of its own (``serve_admin``): then this one answers its
routes 404, as any unknown path."""

from __future__ import annotations

import time

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

import orjson
from pydantic import BaseModel, ValidationError

from control_plane.admin_auth import AdminGuard, ControlPlaneRoutes
from control_plane.metrics import ControlPlaneMetrics
from control_plane.policy_api import PolicyApi
from control_plane.registry_actor import Beat, Deregister, Register, Snapshot
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
    sse_event,
    stream_until_disconnect,
)
from hedgerow.decimal_text import parse_decimal
from hedgerow.errors import InvalidRequest
from hedgerow.latest import LatestValue
from hedgerow.metrics import CONTENT_TYPE
from hedgerow.wire import Heartbeat, RegisterReply, RegistrySnapshot, WorkerRegistration

MAX_BODY = 64 * 1024
ASK_TIMEOUT_S = 5.0
WATCH_KEEPALIVE_S = 15.0

M = TypeVar("M", bound=BaseModel)


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

    def __post_init__(self) -> None:
        self.router = Router()
        self.admin_router = Router() if self.admin_listener else self.router
        routes = ControlPlaneRoutes(self.router, self.admin_router, self.guard)
        routes.open("GET", "/healthz", self.healthz)
        routes.open("GET", "/metrics", self.prometheus)
        routes.open("GET", "/v1/workers", self.list_workers)
        routes.open("POST", "/v1/workers", self.register)
        routes.open("POST", "/v1/workers/{worker_id}/heartbeat", self.heartbeat)
        routes.open("DELETE", "/v1/workers/{worker_id}", self.deregister)
        routes.open("GET", "/v1/watch", self.watch)
        routes.admin("GET", "/v1/status", self.status)
        if self.admin_listener:  # a probe for the admin listener itself, token-free
            self.admin_router.add("GET", "/healthz", self.healthz)
        if self.policy_api is not None:
            self.policy_api.add_routes(routes)
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
             "models": list(w.registration.models), "slots": w.registration.slots,
             "active": w.load.active, "draining": w.load.draining,
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

    async def register(self, request: Request) -> None:
        registration = await _parse(request, WorkerRegistration)
        await self.registry.ask(Register(registration), timeout=ASK_TIMEOUT_S)
        reply = RegisterReply(
            worker_id=registration.worker_id,
            lease_s=self.lease_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
        )
        await send_json(request.send, 201, reply.model_dump(mode="json"))

    async def heartbeat(self, request: Request) -> None:
        beat = await _parse(request, Heartbeat)
        worker_id = request.path_params["worker_id"]
        await self.registry.ask(Beat(worker_id, beat.load), timeout=ASK_TIMEOUT_S)
        await send_json(request.send, 200, {"worker_id": worker_id, "lease_s": self.lease_s})

    async def deregister(self, request: Request) -> None:
        worker_id = request.path_params["worker_id"]
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
            await stream_until_disconnect(request, 200, list(SSE_HEADERS), self._snapshots(start))

    async def _snapshots(self, version: int) -> AsyncIterator[bytes]:
        while True:
            snapshot: RegistrySnapshot | None = None
            with anyio.move_on_after(WATCH_KEEPALIVE_S):
                version, snapshot = await self.published.wait_newer(version)
            if snapshot is None:
                yield b": keep-alive\n\n"
            else:
                yield sse_event(snapshot.model_dump(mode="json"))


async def _parse(request: Request, model: type[M]) -> M:
    body = await request.body(MAX_BODY)
    try:
        return model.model_validate(orjson.loads(body))
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"body is not valid JSON: {error}") from None
    except ValidationError as error:
        raise InvalidRequest(f"invalid {model.__name__}: {error.errors()[0]['msg']}") from None
