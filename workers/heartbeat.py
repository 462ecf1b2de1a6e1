"""The worker's link to the control plane: register, heartbeat, deregister.

An actor with a one-second tick. While unregistered (first start, or the
control plane forgot us after a restart) each tick tries to register; once
registered each tick sends the current load. A control plane that is down is
logged, not fatal: the worker keeps serving and keeps trying; so is one that
answers with an error status (a 503 while its Redis restarts).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from hedgerow.actors import Actor
from hedgerow.trust.peer import Revocations
from hedgerow.wire import Heartbeat, SelfRegistration, WorkerLoad

log = logging.getLogger("hedgerow.worker.heartbeat")

HEARTBEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class DeregisterNow:
    """Ask: leave the registry before draining (returns True when it did)."""


class HeartbeatActor(Actor):
    tick_interval = HEARTBEAT_INTERVAL_S

    def __init__(
        self,
        control_plane_url: str,
        registration: SelfRegistration,
        current_load: Callable[[], WorkerLoad],
        *,
        verify: ssl.SSLContext | bool = True,
        revocations: Revocations | None = None,
    ) -> None:
        """``verify``: the worker's mutual-TLS client context (its certificate)."""
        self.base = control_plane_url.rstrip("/")
        self.registration = registration
        self.current_load = current_load
        self.registered = False
        self.leaving = False
        self._reported_down = False
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), verify=verify)
        self.revocations = revocations

    async def on_start(self) -> None:
        await self.on_tick()

    async def on_stop(self) -> None:
        await self.client.aclose()

    async def receive(self, message: Any) -> Any:
        if not isinstance(message, DeregisterNow):
            raise TypeError(f"unexpected message {message!r}")
        self.leaving = True
        if not self.registered:
            return False
        url = f"{self.base}/v1/workers/{self.registration.worker_id}"
        response = await self.client.delete(url)
        self.registered = False
        log.info("deregistered from %s (%d)", self.base, response.status_code)
        return response.status_code == 200

    async def on_tick(self) -> None:
        if self.leaving:
            return
        try:
            if self.registered:
                await self._beat()
            else:
                await self._register()
            self._reported_down = False
        except httpx.TransportError as error:
            self._report_down(f"unreachable ({error})")
        except httpx.HTTPStatusError as error:
            # A 503 while the control plane's Redis restarts, a 5xx from a proxy in
            # between, a 401 while a renewal is under way: none of them may crash
            # this actor, or enough of them in a minute would leave it dead and
            # the worker out of the fleet for good. Keep trying each tick.
            self._report_down(f"answered {error.response.status_code}")

    def _report_down(self, what: str) -> None:
        """One log line per outage, however many ticks it lasts."""
        if not self._reported_down:
            log.warning("control plane %s %s; retrying", self.base, what)
            self._reported_down = True

    async def _register(self) -> None:
        body = self.registration.model_dump(mode="json")
        response = await self.client.post(f"{self.base}/v1/workers", json=body)
        response.raise_for_status()
        self.registered = True
        log.info("registered %s with %s", self.registration.worker_id, self.base)

    async def _beat(self) -> None:
        url = f"{self.base}/v1/workers/{self.registration.worker_id}/heartbeat"
        beat = Heartbeat(load=self.current_load())
        response = await self.client.post(url, json=beat.model_dump(mode="json"))
        if response.status_code == 404:
            log.warning("control plane forgot %s; registering again", self.registration.worker_id)
            self.registered = False
            await self._register()
            return
        response.raise_for_status()
        if self.revocations is not None:
            self.revocations.update(response.json().get("revoked"))
