"""The gateway process: follow the registry, serve the API over h1/h2/h3."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from gateway.app import GatewayApp
from gateway.dispatch import Dispatcher
from gateway.devcert import ensure_dev_certificate
from gateway.follower import RegistryFollower
from gateway.policy_follower import PolicyFollower, RunningPolicy
from gateway.scheduler import SchedulerActor
from gateway.transport import build_config, serve
from gateway.upstream import WorkerClient
from hedgerow.actors import Supervisor
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.loader import policy_checksum
from policies.schema import DEFAULT_POLICY_PATH, load_policy

log = logging.getLogger("hedgerow.gateway")


@dataclass(frozen=True)
class GatewayOptions:
    control_plane: str = "http://127.0.0.1:8500"
    host: str = "127.0.0.1"
    port: int = 8443
    state_dir: Path = Path(".hedgerow")
    certfile: Path | None = None
    keyfile: Path | None = None
    # A local policy file pins the gateway to it. None: follow the control
    # plane's policy versions (starting from the shipped default until the
    # control plane answers).
    policy_path: Path | None = None
    gateway_id: str | None = None


@dataclass(frozen=True)
class GatewayStarted:
    port: int
    ca_cert: Path | None


async def run_gateway(
    options: GatewayOptions,
    shutdown: anyio.Event,
    *,
    task_status: TaskStatus[GatewayStarted] = anyio.TASK_STATUS_IGNORED,
) -> None:
    policy = load_policy(options.policy_path or DEFAULT_POLICY_PATH)
    certfile, keyfile, ca_cert = _certificate(options)
    directory: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0), -1)
    workers = WorkerClient(policy.timeouts)
    try:
        async with Supervisor() as supervisor:
            follower = RegistryFollower(options.control_plane, directory)
            supervisor.run_service("registry-follower", follower.run)
            scheduler = await supervisor.spawn(
                lambda: SchedulerActor(policy, directory), name="scheduler", mailbox_size=4096)
            app = GatewayApp(policy, directory, scheduler,
                             Dispatcher(scheduler, workers, policy))
            if options.policy_path is None:
                gateway_id = options.gateway_id or f"gw-{socket.gethostname()}-{options.port}"
                policies = PolicyFollower(options.control_plane, gateway_id, app.apply_policy,
                                          RunningPolicy(0, policy_checksum(policy)))
                supervisor.run_service("policy-follower", policies.run)
            else:
                log.info("policy pinned to %s (not following the control plane)",
                         options.policy_path)
            config = build_config(host=options.host, port=options.port,
                                  certfile=certfile, keyfile=keyfile)
            async with anyio.create_task_group() as tg:
                port = await tg.start(serve, app, config, shutdown.wait)
                log.info("gateway listening on https://%s:%d (h1, h2, h3)", options.host, port)
                task_status.started(GatewayStarted(port, ca_cert))
    finally:
        await workers.aclose()


def _certificate(options: GatewayOptions) -> tuple[Path, Path, Path | None]:
    if options.certfile and options.keyfile:
        return options.certfile, options.keyfile, None
    dev = ensure_dev_certificate(options.state_dir)
    log.info("development certificate: %s (trust %s)", dev.cert, dev.ca_cert)
    return dev.cert, dev.key, dev.ca_cert
