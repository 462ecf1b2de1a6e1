"""The actor that owns the control plane's registry.

It is the only code that touches ``Registry``: HTTP handlers ask it, its tick
expires leases, and every new version is published to watchers through a
``LatestValue`` cell (watchers only ever see whole, consistent snapshots).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from control_plane.metrics import ControlPlaneMetrics
from control_plane.registry import Registry
from hedgerow.actors import Actor
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRegistration

log = logging.getLogger("hedgerow.control_plane")


@dataclass(frozen=True)
class Register:
    registration: WorkerRegistration


@dataclass(frozen=True)
class Beat:
    worker_id: str
    load: WorkerLoad


@dataclass(frozen=True)
class Deregister:
    worker_id: str


@dataclass(frozen=True)
class Snapshot:
    pass


class RegistryActor(Actor):
    tick_interval = 0.2

    def __init__(self, registry: Registry, published: LatestValue[RegistrySnapshot],
                 metrics: ControlPlaneMetrics) -> None:
        self.registry = registry
        self.published = published
        self.metrics = metrics

    async def on_start(self) -> None:
        self._publish()

    async def receive(self, message: Any) -> Any:
        now = time.monotonic()
        match message:
            case Register(registration):
                self.registry.register(registration, now)
                self.metrics.registrations.inc()
                log.info("worker %s registered at %s", registration.worker_id, registration.url)
            case Beat(worker_id, load):
                self.registry.heartbeat(worker_id, load, now)
            case Deregister(worker_id):
                self.registry.deregister(worker_id)
                self.metrics.deregistrations.inc()
                log.info("worker %s deregistered", worker_id)
            case Snapshot():
                return self.registry.snapshot(now)
            case _:
                raise TypeError(f"unexpected message {message!r}")
        self._publish()
        return None

    async def on_tick(self) -> None:
        dead = self.registry.expire(time.monotonic())
        if dead:
            self.metrics.expiries.inc(len(dead))
        for worker_id in dead:
            log.warning("worker %s missed its heartbeats; lease expired", worker_id)
        self._publish()

    def _publish(self) -> None:
        if self.registry.version > self.published.version:
            self.published.publish(
                self.registry.snapshot(time.monotonic()), self.registry.version
            )
