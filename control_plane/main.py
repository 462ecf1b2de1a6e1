"""The control-plane process: the registry actor behind its HTTP API."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
from anyio.abc import TaskGroup, TaskStatus

from control_plane.admin_auth import LOOPBACK, AdminGuard, admin_bind_host
from control_plane.app import ControlPlaneApp
from control_plane.metrics import ControlPlaneMetrics
from control_plane.policy_service import start_policy_service
from control_plane.registry import Registry
from control_plane.registry_actor import RegistryActor
from control_plane.shared_state import close_redis, open_redis, registry_actor_factory
from control_plane.upstream_api import start_upstream_service
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
    admin_token: str | None = None,
    metrics_token: str | None = None,
    redis_url: str | None = None,
    admin_port: int | None = None,
    admin_host: str = LOOPBACK,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """``admin_token``: required by the admin API; without one, the listener
    that serves it is on loopback only. ``metrics_token``: opens ``/metrics``
    (served with the admin API) and nothing else. ``admin_port``: serve the admin API
    there (on ``admin_host``) and nowhere else; None: on ``port`` with the rest.
    Reports the main port on start."""
    if admin_port is None:
        host = admin_bind_host(host, admin_token)
    else:  # the main port then carries no admin route: it binds where asked
        admin_host = admin_bind_host(admin_host, admin_token)
    # The registry outlives actor restarts: each method leaves it consistent,
    # so a crash in one message must not make every worker re-register.
    registry = Registry(lease_s=lease_s)
    published: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0))
    metrics = ControlPlaneMetrics(published)
    redis = open_redis(redis_url) if redis_url else None  # None: in-process state
    async with close_redis(redis), Supervisor() as supervisor:
        factory = registry_actor_factory(redis, lease_s, published, metrics)
        if factory is None:
            factory = lambda: RegistryActor(registry, published, metrics)  # noqa: E731
        actor = await supervisor.spawn(factory, name="registry")
        policy_api = await start_policy_service(supervisor, policy_file, policy_dir, redis)
        upstream_api = await start_upstream_service(supervisor, actor, policy_api.published,
                                                    lease_s)
        app = ControlPlaneApp(actor, published, lease_s, HEARTBEAT_INTERVAL_S, metrics,
                              policy_api, upstream_api, AdminGuard(admin_token, metrics_token),
                              admin_listener=admin_port is not None)
        async with anyio.create_task_group() as tg:
            bound = await tg.start(serve_internal, app, host, port, shutdown)
            log.info("control plane listening on http://%s:%d", host, bound)
            if admin_port is not None:
                await _serve_admin(tg, app, admin_host, admin_port, shutdown)
            task_status.started(bound)


async def _serve_admin(tg: TaskGroup, app: ControlPlaneApp, host: str, port: int,
                       shutdown: anyio.Event) -> None:
    bound = await tg.start(serve_internal, app.serve_admin, host, port, shutdown)
    log.info("control plane admin API listening on http://%s:%d%s", host, bound,
             "" if app.guard.enabled else " (no admin token: unauthenticated)")
