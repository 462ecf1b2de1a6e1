"""The control-plane process: the registry actor behind its HTTP API."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from control_plane.app import ControlPlaneApp
from control_plane.metrics import ControlPlaneMetrics
from control_plane.policy_service import start_policy_service
from control_plane.registry import Registry
from control_plane.registry_actor import RegistryActor
from hedgerow.actors import Supervisor
from hedgerow.latest import LatestValue
from hedgerow.serving import serve_internal
from hedgerow.wire import RegistrySnapshot
from policies.schema import DEFAULT_POLICY_PATH

log = logging.getLogger("hedgerow.control_plane")

DEFAULT_LEASE_S = 3.0
HEARTBEAT_INTERVAL_S = 1.0


async def run_control_plane(
    host: str,
    port: int,
    shutdown: anyio.Event,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    policy_file: Path = DEFAULT_POLICY_PATH,
    policy_dir: Path | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    # The registry outlives actor restarts: each method leaves it consistent,
    # so a crash in one message must not make every worker re-register.
    registry = Registry(lease_s=lease_s)
    published: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0))
    metrics = ControlPlaneMetrics(published)
    async with Supervisor() as supervisor:
        actor = await supervisor.spawn(lambda: RegistryActor(registry, published, metrics),
                                       name="registry")
        policy_api = await start_policy_service(supervisor, policy_file, policy_dir)
        app = ControlPlaneApp(actor, published, lease_s, HEARTBEAT_INTERVAL_S, metrics,
                              policy_api)
        async with anyio.create_task_group() as tg:
            bound = await tg.start(serve_internal, app, host, port, shutdown)
            log.info("control plane listening on http://%s:%d", host, bound)
            task_status.started(bound)
