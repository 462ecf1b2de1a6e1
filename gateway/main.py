"""The gateway process: follow the registry, serve the API over h1/h2/h3."""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import TaskGroup, TaskStatus

from hedgerow.admin_token import admin_bind_host
from gateway.admin.api import GatewayAdmin
from gateway.app import GatewayApp
from gateway.cache import ResponseCache
from gateway.cache.shared_embedder import SocketEmbedder
from gateway.edge.cert_reload import DEFAULT_POLL_S, CertificateReloader
from hedgerow.connection_cap import DEFAULT_MAX_CONNECTIONS, ConnectionCap, fit_file_limit
from hedgerow.gc_tuning import tune_for_serving
from gateway.edge.cors import CorsMiddleware
from gateway.edge.security_headers import SecurityHeaders
from hedgerow.source_limits import SourceLimits, SourceLimitsConfig
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.drain import Drain
from gateway.edge.devcert import ensure_dev_certificate
from gateway.followers.follower import RegistryFollower
from gateway.corridor.key_gate import KeyGate, LocalBudgets
from gateway.followers.key_secret import KeySecretFetcher
from gateway.followers.policy_follower import PolicyFollower, RunningPolicy
from gateway.corridor.scheduler import Scheduler
from gateway.corridor.scheduling import CLOCK_RESTARTS, SchedulerClock, SchedulerDoor
from gateway.corridor.shared_budgets import SharedBudgets
from gateway.corridor.shared_limits import open_shared_limits
from gateway.edge.quic_admission import QuicFrontDoor, QuicLimits
from gateway.edge.h2_budget import H2Limits
from gateway.edge.h2_guard import H2_GUARD_STATS
from gateway.edge.ticket_keys import DEFAULT_ROTATION_S
from gateway.edge.transport import (MAX_REQUESTS_PER_CONNECTION, QUIC_SESSION_TICKETS,
                                    Listeners, build_config, local_hosts, serve)
from gateway.upstream.client import WorkerClient
from hedgerow.actors import Supervisor
from hedgerow.body_budget import DEFAULT_BODY_BUDGET_BYTES, BodyBudget
from hedgerow.latest import LatestValue
from hedgerow.redis_conn import RedisTls, check_redis, warm_up
from hedgerow.serving import serve_internal
from hedgerow.http_stack import check_versions
from hedgerow.trust.peer import require_roles
from hedgerow.trust.process import InternalTls
from hedgerow.wire import RegistrySnapshot
from policies.schema import DEFAULT_POLICY_PATH, Policy, load_policy

log = logging.getLogger("hedgerow.gateway")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# Hypercorn's graceful timeout outlasts the drain deadline by this much, so the
# streams cut at the deadline can still write their error events before
# hypercorn cancels what is left.
DRAIN_GRACE_S = 2.0
# A process of ``--processes N`` waits this long at most for its first policy
# and registry snapshot before it starts accepting (see ``_first_view``).
FIRST_VIEW_WAIT_S = 5.0


@dataclass(frozen=True)
class ProcessSlot:
    """This process is ``index`` of ``count`` serving one port (``gateway.edge.processes``):
    it serves the sockets its parent bound, and its admin listener is on admin_port + index."""

    index: int
    count: int
    listeners: Listeners
    # The supervisor's embedding sidecar, shared by every process (None: run one's own),
    # and how to ask the supervisor to start it.
    embed_socket: Path | None = None
    want_embedder: Callable[[], None] | None = None


@dataclass(frozen=True)
class GatewayOptions:
    control_plane: str = "https://127.0.0.1:8500"
    # One address or several; by default IPv4 and IPv6 loopback, since browsers
    # try ::1 first for localhost (and a forced QUIC connection never falls back).
    host: str | tuple[str, ...] = field(default_factory=local_hosts)
    port: int = 8443
    state_dir: Path = Path(".hedgerow")
    certfile: Path | None = None
    keyfile: Path | None = None
    # A local policy file pins the gateway to it. None: follow the control
    # plane's policy versions; until the first arrives the client API answers
    # 503 policy_unavailable (never a built-in default nobody chose).
    policy_path: Path | None = None
    gateway_id: str | None = None
    # After SIGTERM, how long in-flight requests may run before they are cut.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # This gateway's PoP: routing prefers workers labelled pop=<it> (policies.locality).
    pop: str | None = None
    # Tenants' requests/s and tokens/min limits shared with every gateway on this Redis
    # (``gateway.corridor.shared_limits``), and the response cache. None: each gateway on
    # its own. Kept out of repr: the URL may carry the ACL user's password.
    redis_url: str | None = field(default=None, repr=False)
    redis_tls: RedisTls = RedisTls()
    # The admin API (cache purge, stats; ``gateway.admin.api``) on its own plain
    # HTTP listener. None: not served. Without a token: loopback only.
    admin_port: int | None = None
    admin_host: str = "127.0.0.1"
    admin_token: str | None = None
    # Opens /metrics on the admin listener, and nothing else (for Prometheus).
    metrics_token: str | None = None
    # Open TCP connections; beyond it new ones are closed at accept, before TLS.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # QUIC handshakes (Retry, half-open caps, timeout) and HTTP/3 header bounds.
    quic: QuicLimits = QuicLimits()
    # Requests per connection (then HTTP/2 drains gracefully) and the
    # per-connection HTTP/2 flood budgets (``gateway.edge.h2_budget``).
    max_requests_per_connection: int = MAX_REQUESTS_PER_CONNECTION
    h2_limits: H2Limits = H2Limits()
    # Per client IP and /24 (IPv6: /64), checked at accept before the cap above:
    # open connections and new connections per second (``hedgerow.source_limits``).
    source_limits: SourceLimitsConfig = field(default_factory=SourceLimitsConfig)
    # How often the public certificate and key are checked for a change (and
    # reloaded); 0: only on SIGHUP.
    certificate_poll_s: float = DEFAULT_POLL_S
    # TLS session ticket keys (TCP) and QUIC tickets rotate this often; a
    # ticket resumes for one more period after its own (1-2 periods in all).
    ticket_rotation_s: float = DEFAULT_ROTATION_S
    # The process's garbage collector tuned once startup is done
    # (``hedgerow.gc_tuning``): set by the CLI, which owns the process; not by
    # a caller that runs a gateway inside its own process (the tests).
    tune_gc: bool = False
    # HTTP/1.1 clients served by ``hedgerow.h1`` (--http1 native, the default), or
    # by hypercorn's h11 path (--http1 hypercorn).
    native_http1: bool = True
    # Request bodies being read, all requests together; beyond it new ones get 503.
    max_buffered_body_bytes: int = DEFAULT_BODY_BUDGET_BYTES
    # Mutual TLS to the control plane and workers, and on the admin listener;
    # None: plain HTTP (--insecure-internal, and tests of the gateway alone).
    internal_tls: InternalTls | None = None
    # One of ``--processes N``; None: the only process, binding its own sockets.
    process: ProcessSlot | None = field(default=None, repr=False)


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
    check_versions()  # the pinned hypercorn/aioquic/h2, or refuse to start
    # Following the control plane, the shipped default only builds the parts;
    # ``awaiting_policy`` keeps it from serving anyone until the first version.
    policy = load_policy(options.policy_path or DEFAULT_POLICY_PATH)
    following = options.policy_path is None
    certfile, keyfile, ca_cert = _certificate(options)
    directory: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0), -1)
    tls = options.internal_tls or InternalTls(None, options.control_plane)
    workers = WorkerClient(policy.timeouts, internal_tls=tls.contexts)
    shared = (open_shared_limits(options.redis_url, options.redis_tls)
              if options.redis_url else None)
    # Exact and semantic response cache, shared through Redis when given one.
    origin = options.gateway_id or f"gw-{options.port}"
    if options.process is not None:  # semantic cache ids are unique per process
        origin = f"{origin}/p{options.process.index}"
    process = options.process
    embedder = (SocketEmbedder(process.embed_socket, on_start=process.want_embedder)
                if process is not None and process.embed_socket is not None else None)
    cache = ResponseCache(policy, options.redis_url, redis_tls=options.redis_tls,
                          origin=origin, embedder=embedder)
    try:
        if cache.redis is not None and options.redis_url is not None:
            # A wrong CA, password or ACL stops the start here; an unreachable
            # Redis does not (limits and cache fall back to this gateway's own).
            if await check_redis(cache.redis, options.redis_url, options.redis_tls,
                                 what="shared limits and cache (Redis)") and shared is not None:
                await warm_up(shared.redis)
        async with Supervisor() as supervisor:
            follower = RegistryFollower(options.control_plane, directory, verify=tls.client())
            supervisor.run_service("registry-follower", follower.run)
            renewer = tls.renewer()
            if renewer is not None:
                supervisor.run_service("certificate-renewer", renewer.run)
            # A plain object the request path calls; the clock task only borrows it,
            # so a crash of that task (restarted) loses no queue and no policy.
            scheduler = Scheduler(policy, directory, pop=options.pop)
            supervisor.run_service("scheduler-clock", SchedulerClock(scheduler).run,
                                  restart_policy=CLOCK_RESTARTS)
            supervisor.run_service("response-cache", cache.run)
            app = GatewayApp(policy, directory, SchedulerDoor(scheduler, shared),
                             Dispatcher(scheduler, workers, policy), cache=cache,
                             awaiting_policy=following,
                             body_budget=BodyBudget(options.max_buffered_body_bytes))
            # Budgets across gateways through the shared limits' Redis, else this gateway's own.
            app.keys = KeyGate(budgets=SharedBudgets(shared.redis) if shared is not None
                               else LocalBudgets(), shared_rates=shared)
            supervisor.run_service("key-secret", KeySecretFetcher(
                options.control_plane, app.keys, verify=tls.client()).run)
            app.metrics.watch_body_budget(app.body_budget.stats)
            app.metrics.watch_cache(cache.stats)
            connections = ConnectionCap(fit_file_limit(options.max_connections),
                                        SourceLimits(options.source_limits))
            app.metrics.watch_connections(connections.stats)
            quic_door = QuicFrontDoor(options.quic, connections)
            app.metrics.watch_quic(quic_door.stats)
            app.metrics.watch_h2(H2_GUARD_STATS.snapshot)
            edge = CorsMiddleware(app, policy.cors, app.router.serves)

            policy_arrived = anyio.Event()

            async def apply_policy(new: Policy) -> None:
                edge.apply_policy(new)
                await app.apply_policy(new)
                policy_arrived.set()

            if shared is not None:
                log.info("tenants' requests/s and tokens/min limits are shared through Redis")
            if following:
                gateway_id = options.gateway_id or default_gateway_id(options.port)
                # No checksum: the first version is applied even when it equals the default.
                policies = PolicyFollower(options.control_plane, gateway_id, apply_policy,
                                          RunningPolicy(0, ""), verify=tls.client())
                supervisor.run_service("policy-follower", policies.run)
                log.info("following the control plane's policy at %s; the client API "
                         "answers 503 until the first version arrives", options.control_plane)
            else:
                policy_arrived.set()
                log.info("policy pinned to %s (not following the control plane)",
                         options.policy_path)
            certificates = CertificateReloader(certfile, keyfile,
                                               poll_s=options.certificate_poll_s)
            app.metrics.watch_certificates(certificates.stats)
            supervisor.run_service("certificate-reloader", certificates.run)
            config = build_config(host=options.host, port=options.port,
                                  certfile=certfile, keyfile=keyfile,
                                  graceful_timeout_s=options.drain_timeout_s + DRAIN_GRACE_S,
                                  h2_limits=options.h2_limits,
                                  max_requests_per_connection=options.max_requests_per_connection,
                                  ticket_rotation_s=options.ticket_rotation_s,
                                  native_http1=options.native_http1)
            ring = getattr(config, "ticket_keys", None)
            app.metrics.watch_tickets(lambda: {
                "tcp": ring.stats() if ring is not None else {},
                "quic": QUIC_SESSION_TICKETS.statistics()})
            async with anyio.create_task_group() as tg:

                async def drain_on_shutdown() -> None:
                    await shutdown.wait()
                    await _begin_drain(app.drain, options.drain_timeout_s, tg)

                if options.admin_port is not None:
                    admin = GatewayAdmin(cache, options.admin_token, app.render_metrics,
                                         options.metrics_token)
                    await _serve_admin(tg, admin, options, shutdown, tls)
                else:
                    log.info("no --admin-port: metrics and the cache admin API are not served")
                if options.process is not None:
                    await _first_view(directory, policy_arrived, FIRST_VIEW_WAIT_S)
                if options.tune_gc:
                    tune_for_serving()  # startup is done: what it built is never collected
                port = await tg.start(functools.partial(serve, connection_cap=connections,
                                                        quic_door=quic_door,
                                                        listeners=None if options.process
                                                        is None else options.process.listeners,
                                                        certificates=certificates),
                                      SecurityHeaders(edge), config, drain_on_shutdown)
                hosts = [options.host] if isinstance(options.host, str) else options.host
                log.info("gateway listening on %s (h1, h2, h3)", ", ".join(
                    f"https://{f'[{h}]' if ':' in h else h}:{port}" for h in hosts))
                task_status.started(GatewayStarted(port, ca_cert))
    finally:
        await workers.aclose()
        with anyio.CancelScope(shield=True):
            await cache.aclose()
        if shared is not None:
            await shared.redis.aclose()


async def _first_view(directory: LatestValue[RegistrySnapshot], policy_arrived: anyio.Event,
                      bound_s: float) -> None:
    """Wait, at most ``bound_s``, for the first policy and registry snapshot.

    For a process of ``--processes N`` only: its socket already listens (the
    supervisor bound it), so the kernel hands it a share of new connections
    whether or not it has started. Serving before its first snapshot answered
    them 503 ``no_healthy_worker`` for ~100 ms while its siblings (and
    ``/readyz``) said the port was ready; waiting keeps those connections in
    the backlog instead. Past the bound (a control plane that does not answer)
    it serves anyway, so clients get the 503 that explains, not a silent queue.
    """
    with anyio.move_on_after(bound_s) as waited:
        await directory.wait_newer(-1)
        await policy_arrived.wait()
    if waited.cancelled_caught:
        log.warning("serving without %s from the control plane after %.0fs; the client "
                    "API answers 503 until it arrives",
                    "a registry snapshot" if directory.version < 0 else "a policy", bound_s)


async def _serve_admin(tg: TaskGroup, admin: GatewayAdmin, options: GatewayOptions,
                       shutdown: anyio.Event, tls: InternalTls) -> None:
    """With internal TLS: mutual TLS, role admin (and the token when one is set),
    on the host asked. Without: plain HTTP, on loopback unless a token guards it."""
    assert options.admin_port is not None
    admin_port = options.admin_port
    if options.process is not None and admin_port != 0:
        admin_port += options.process.index  # process i of --processes N: admin port + i
    if tls.enabled:
        host, served = options.admin_host, require_roles(admin, ("admin",))
    else:
        host, served = admin_bind_host(options.admin_host, options.admin_token), admin
    port = await tg.start(functools.partial(serve_internal, tls=tls.server()), served, host,
                          admin_port, shutdown)
    log.info("gateway admin API and /metrics listening on %s://%s:%d%s", tls.scheme, host, port,
             "" if options.admin_token or tls.enabled else " (no admin token: unauthenticated)")


def default_gateway_id(port: int) -> str:
    return f"gw-{socket.gethostname()}-{port}"


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
