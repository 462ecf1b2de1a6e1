"""The worker's heartbeat outlives a control plane that answers with errors.

A control plane whose Redis restarts answers 503 for a few seconds. Each tick
that raised would crash the heartbeat actor, and a supervisor gives up on an
actor that crashes six times in a minute: the worker would leave the fleet for
good although it is healthy. The actor must keep trying and come back."""

from __future__ import annotations

import logging

import anyio
import httpx
import pytest

from hedgerow.wire import SelfRegistration, WorkerLoad
from workers.heartbeat import HeartbeatActor

REGISTRATION = SelfRegistration(worker_id="w1", url="https://127.0.0.1:9/", kind="cpu",
                                models=("m",), slots=1)


class ControlPlane:
    """Answers ``down`` requests with 503, then registers and renews."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        if self.down > 0:
            self.down -= 1
            return httpx.Response(503, json={"error": {"message": "registry store unreachable"}})
        if request.url.path.endswith("/heartbeat"):
            return httpx.Response(200, json={"revoked": []})
        return httpx.Response(201, json={})


def heartbeat_with(control_plane: ControlPlane) -> HeartbeatActor:
    actor = HeartbeatActor("https://control-plane.test", REGISTRATION, WorkerLoad)
    actor.client = httpx.AsyncClient(transport=httpx.MockTransport(control_plane))
    return actor


def test_a_control_plane_answering_503_for_many_ticks_is_retried_not_fatal(
        caplog: pytest.LogCaptureFixture) -> None:
    control_plane = ControlPlane(down=10)  # more ticks than a supervisor forgives crashes
    actor = heartbeat_with(control_plane)

    async def ticks(n: int) -> None:
        for _ in range(n):
            await actor.on_tick()

    with caplog.at_level(logging.WARNING, logger="hedgerow.worker.heartbeat"):
        anyio.run(ticks, 10)
        assert not actor.registered
        anyio.run(ticks, 2)
    assert actor.registered
    assert control_plane.calls[-2:] == ["POST /v1/workers", "POST /v1/workers/w1/heartbeat"]
    warnings = [r.getMessage() for r in caplog.records if "answered 503" in r.getMessage()]
    assert len(warnings) == 1  # one line for the whole outage


def test_a_503_on_a_heartbeat_keeps_the_registration_and_beats_again() -> None:
    control_plane = ControlPlane(down=0)
    actor = heartbeat_with(control_plane)
    anyio.run(actor.on_tick)
    assert actor.registered
    control_plane.down = 3

    async def ticks() -> None:
        for _ in range(4):
            await actor.on_tick()

    anyio.run(ticks)
    assert actor.registered
    assert control_plane.calls[-1] == "POST /v1/workers/w1/heartbeat"
