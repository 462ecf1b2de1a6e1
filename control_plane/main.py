"""The control-plane process: the registry actor behind its HTTP API."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import anyio
from anyio.abc import TaskGroup, TaskStatus

from control_plane.admin_auth import AdminGuard
from hedgerow.admin_token import LOOPBACK, admin_bind_host
from control_plane.app import ControlPlaneApp
from control_plane.metrics import ControlPlaneMetrics
from control_plane.key_file import restore_keys, save_keys
from control_plane.policy_service import start_policy_service
from control_plane.registry import Registry
from control_plane.registry_actor import RegistryActor
from control_plane.shared_state import registry_actor_factory, shared_redis
from control_plane.shared_trust import SharedTrust
from control_plane.trust_service import (ADMIN_CERT_TTL, DEFAULT_CERT_TTL_S, SERVING_CERT_TTL,
                                         SERVING_RENEW_BEFORE, TrustService, serving_names)
from control_plane.upstream_api import start_upstream_service
from hedgerow.actors import Supervisor
from hedgerow.connection_cap import fit_file_limit
from hedgerow.latest import LatestValue
from hedgerow.listener_limits import INTERNAL, JOIN, ListenerLimits
from hedgerow.redis_conn import RedisTls
from hedgerow.serving import serve_internal
from hedgerow.http_stack import check_versions
from hedgerow.trust.credentials import Credentials, TlsContexts
from hedgerow.trust.identity import Identity
from hedgerow.wire import RegistrySnapshot
from policies.schema import DEFAULT_POLICY_PATH

log = logging.getLogger("hedgerow.control_plane")

CONTROL_PLANE = Identity("control-plane", "control-plane")
LOCAL_ADMIN = Identity("admin", "local")
SERVING_CHECK_S = 3600.0
DEFAULT_LEASE_S = 3.0
HEARTBEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class TrustOptions:
    """Internal trust of a control plane: where its CA and book live, or None
    in ``TrustOptions.insecure`` (plain HTTP, nothing checked: debugging only)."""

    state_dir: Path = Path(".hedgerow/control-plane")
    join_port: int = 8501
    ca_cert: Path | None = None
    ca_key: Path | None = None
    cert_ttl_s: float = DEFAULT_CERT_TTL_S
    tls_sans: tuple[str, ...] = ()  # more names clients reach it by (DNS or IP)
    insecure: bool = False


async def run_control_plane(
    host: str,
    port: int,
    shutdown: anyio.Event,
    *,
    trust_options: TrustOptions = TrustOptions(),
    lease_s: float = DEFAULT_LEASE_S,
    policy_file: Path = DEFAULT_POLICY_PATH,
    policy_dir: Path | None = None,
    admin_token: str | None = None,
    metrics_token: str | None = None,
    redis_url: str | None = None,
    redis_tls: RedisTls = RedisTls(),
    admin_port: int | None = None,
    admin_host: str = LOOPBACK,
    internal_limits: ListenerLimits = INTERNAL,
    join_limits: ListenerLimits = JOIN,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """``admin_token``: required by the admin API; without one, the listener
    that serves it is on loopback only. ``metrics_token``: opens ``/metrics``
    (served with the admin API) and nothing else. ``admin_port``: serve the admin API
    there (on ``admin_host``) and nowhere else; None: on ``port`` with the rest.
    ``internal_limits``, ``join_limits``: connection limits of the main (``port``)
    and join listeners, applied at accept over TLS (``hedgerow.listener_limits``).
    Reports the main port on start."""
    check_versions()  # the pinned hypercorn/h2, or refuse to start
    trust, contexts = _open_trust(trust_options, host, admin_host)
    if trust is None:  # plain HTTP: without a token the admin API stays on loopback
        if admin_port is None:
            host = admin_bind_host(host, admin_token)
        else:  # the main port then carries no admin route: it binds where asked
            admin_host = admin_bind_host(admin_host, admin_token)
    server_tls = contexts.server() if contexts is not None else None
    # The registry outlives actor restarts: each method leaves it consistent,
    # so a crash in one message must not make every worker re-register.
    registry = Registry(lease_s=lease_s)
    published: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0))
    metrics = ControlPlaneMetrics(published)
    # redis is None without a URL: in-process state.
    async with shared_redis(redis_url, redis_tls) as redis, Supervisor() as supervisor:
        if trust is not None and redis is not None:
            # Tokens and revocations reach every replica on this Redis.
            trust.shared = SharedTrust(redis, trust.book_mac_key())
            await trust.refresh()
            supervisor.run_service("trust-sync", trust.follow_shared)
        factory = registry_actor_factory(redis, lease_s, published, metrics)
        if factory is None:
            factory = lambda: RegistryActor(registry, published, metrics)  # noqa: E731
        actor = await supervisor.spawn(factory, name="registry")
        policy_api = await start_policy_service(supervisor, policy_file, policy_dir, redis)
        if redis is None and trust is not None:  # versions in memory: keep the keys on disk
            keys_file = trust_options.state_dir / "keys.yaml"
            await restore_keys(policy_api.policies, policy_api.published, keys_file)
            supervisor.run_service("keys-file", partial(save_keys, policy_api.published,
                                                        keys_file))
        upstream_api = await start_upstream_service(supervisor, actor, policy_api.published,
                                                    lease_s)
        app = ControlPlaneApp(actor, published, lease_s, HEARTBEAT_INTERVAL_S, metrics,
                              policy_api, upstream_api, AdminGuard(admin_token, metrics_token),
                              admin_listener=admin_port is not None, trust=trust)
        scheme = "http" if server_tls is None else "https"
        # The open-file limit raised to hold the cap (the join listener's small
        # one fits in fit_file_limit's reserve), or the cap lowered to fit it.
        fitted = fit_file_limit(internal_limits.max_connections)
        internal_limits = replace(internal_limits, max_connections=fitted)
        async with anyio.create_task_group() as tg:
            bound = await tg.start(partial(
                serve_internal, tls=server_tls, connection_cap=internal_limits.cap(),
                handshake_timeout_s=internal_limits.handshake_timeout_s),
                app, host, port, shutdown)
            log.info("control plane listening on %s://%s:%d%s", scheme, host, bound,
                     " (mutual TLS)" if server_tls else "")
            if trust is not None and app.trust_api is not None and contexts is not None:
                joined = await tg.start(partial(
                    serve_internal, tls=contexts.server(require_client_cert=False),
                    connection_cap=join_limits.cap("join-"),
                    handshake_timeout_s=join_limits.handshake_timeout_s),
                    app.trust_api.join_app(), host, trust_options.join_port, shutdown)
                log.info("control plane join API listening on https://%s:%d", host, joined)
                tg.start_soon(_keep_serving_certificate, trust, contexts, trust_options,
                              host, admin_host, shutdown)
            if admin_port is not None:
                await _serve_admin(tg, app, admin_host, admin_port, shutdown, server_tls)
            task_status.started(bound)


def _open_trust(options: TrustOptions, *hosts: str) -> tuple[TrustService | None,
                                                             TlsContexts | None]:
    if options.insecure:
        log.warning("INSECURE: --insecure-internal: the control plane serves plain HTTP and "
                    "believes every caller; anyone who reaches it can register workers and "
                    "read the registry and policy. Never run this outside a debugging session.")
        return None, None
    trust = TrustService.open(options.state_dir, ca_cert=options.ca_cert,
                              ca_key=options.ca_key, cert_ttl_s=options.cert_ttl_s)
    serving = _serving_credentials(trust, options, hosts)
    trust.ensure_credentials(options.state_dir / "admin", LOCAL_ADMIN, lifetime=ADMIN_CERT_TTL,
                             renew_before=SERVING_RENEW_BEFORE)
    log.info("cluster CA %s (%s); admin credential in %s", trust.ca.fingerprint,
             options.ca_cert or options.state_dir / "ca", options.state_dir / "admin")
    return trust, TlsContexts(serving)


def _serving_credentials(trust: TrustService, options: TrustOptions,
                         hosts: tuple[str, ...]) -> Credentials:
    dns, ips = serving_names((*hosts, *options.tls_sans))
    return trust.ensure_credentials(options.state_dir / "identity", CONTROL_PLANE,
                                    lifetime=SERVING_CERT_TTL, renew_before=SERVING_RENEW_BEFORE,
                                    dns_names=dns, ip_addresses=ips)


async def _keep_serving_certificate(trust: TrustService, contexts: TlsContexts,
                                    options: TrustOptions, host: str, admin_host: str,
                                    shutdown: anyio.Event) -> None:
    """Reissue the control plane's own certificate before it lapses, in place."""
    while not shutdown.is_set():
        with anyio.move_on_after(SERVING_CHECK_S):
            await shutdown.wait()
        before = contexts.credentials.certificate().serial_number
        _serving_credentials(trust, options, (host, admin_host))
        if contexts.credentials.certificate().serial_number != before:
            contexts.reload()
            log.info("control plane serving certificate renewed")


async def _serve_admin(tg: TaskGroup, app: ControlPlaneApp, host: str, port: int,
                       shutdown: anyio.Event, tls: ssl.SSLContext | None) -> None:
    bound = await tg.start(partial(serve_internal, tls=tls), app.serve_admin, host, port,
                           shutdown)
    log.info("control plane admin API listening on %s://%s:%d%s", "https" if tls else "http",
             host, bound, "" if app.guard.enabled or tls else " (no admin token: unauthenticated)")
