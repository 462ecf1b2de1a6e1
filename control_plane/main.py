"""The control-plane process: the registry actor behind its HTTP API."""

from __future__ import annotations

import logging

import anyio
from anyio.abc import TaskStatus

from control_plane.app import ControlPlaneApp
from control_plane.registry import Registry
from control_plane.registry_actor import RegistryActor
from hedgerow.actors import Supervisor
from hedgerow.latest import LatestValue
from hedgerow.serving import serve_internal
from hedgerow.wire import RegistrySnapshot

log = logging.getLogger("hedgerow.control_plane")

DEFAULT_LEASE_S = 3.0
HEARTBEAT_INTERVAL_S = 1.0


async def run_control_plane(
    host: str,
    port: int,
    shutdown: anyio.Event,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    # The registry outlives actor restarts: each method leaves it consistent,
    # so a crash in one message must not make every worker re-register.
    registry = Registry(lease_s=lease_s)
    published: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0))
    async with Supervisor() as supervisor:
        actor = await supervisor.spawn(lambda: RegistryActor(registry, published), name="registry")
        app = ControlPlaneApp(actor, published, lease_s, HEARTBEAT_INTERVAL_S)
        async with anyio.create_task_group() as tg:
            bound = await tg.start(serve_internal, app, host, port, shutdown)
            log.info("control plane listening on http://%s:%d", host, bound)
            task_status.started(bound)
