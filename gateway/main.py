"""The gateway process: follow the registry, serve the API over h1/h2/h3."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskGroup, TaskStatus

from gateway.app import GatewayApp
from gateway.dispatch import Dispatcher
from gateway.drain import Drain
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

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# Hypercorn's graceful timeout outlasts the drain deadline by this much, so the
# streams cut at the deadline can still write their error events before
# hypercorn cancels what is left.
DRAIN_GRACE_S = 2.0


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
    # After SIGTERM, how long in-flight requests may run before they are cut.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S


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
                                  certfile=certfile, keyfile=keyfile,
                                  graceful_timeout_s=options.drain_timeout_s + DRAIN_GRACE_S)
            async with anyio.create_task_group() as tg:

                async def drain_on_shutdown() -> None:
                    await shutdown.wait()
                    await _begin_drain(app.drain, options.drain_timeout_s, tg)

                port = await tg.start(serve, app, config, drain_on_shutdown)
                log.info("gateway listening on https://%s:%d (h1, h2, h3)", options.host, port)
                task_status.started(GatewayStarted(port, ca_cert))
    finally:
        await workers.aclose()


async def _begin_drain(drain: Drain, timeout_s: float, tg: TaskGroup) -> None:
    """Refuse new requests and arm the deadline; returning closes the listeners."""
    drain.begin()
    log.info("draining: %d request(s) in flight, deadline %.1fs", drain.in_flight, timeout_s)
    tg.start_soon(drain.cut_after, timeout_s)


def _certificate(options: GatewayOptions) -> tuple[Path, Path, Path | None]:
    if options.certfile and options.keyfile:
        return options.certfile, options.keyfile, None
    dev = ensure_dev_certificate(options.state_dir)
    log.info("development certificate: %s (trust %s)", dev.cert, dev.ca_cert)
    return dev.cert, dev.key, dev.ca_cert
