"""The ``hedgerow`` command: ``up``, ``gateway``, ``control-plane``, ``worker``.

Each process kind runs until SIGINT/SIGTERM, which triggers its graceful
shutdown (a worker drains, a gateway finishes in-flight streams).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import os
import ssl
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from hedgerow import tracing
from hedgerow.cli_env import EnvironmentValueError, apply_environment
from hedgerow.extras import missing_extras
from hedgerow.logs import LOG_FORMATS, configure_logging
from hedgerow.cli_flags import add_listener_limit_options, add_trust_arguments

if TYPE_CHECKING:
    from gateway.main import GatewayOptions
    from gateway.edge.processes import ChildSlot
    from gateway.edge.quic_admission import QuicLimits
    from hedgerow.trust.process import InternalTls
    from hedgerow.redis_conn import RedisTls
    from workers.sim_backend import LatencyModel, SlowPeriods

DEFAULT_CONTROL_PLANE = "https://127.0.0.1:8500"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except EnvironmentValueError as error:
        print(f"hedgerow: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    # ``hedgerow gateway --processes N`` starts its children with the same words.
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as error:  # a bad HEDGEROW_LOG_FORMAT or level
        raise SystemExit(f"hedgerow: {error}") from error
    # `hedgerow up` starts its children as processes of their own: they read it here.
    os.environ["HEDGEROW_LOG_FORMAT"] = args.log_format
    missing = missing_extras(args.command, getattr(args, "backend", None))
    if missing is not None:  # a role that is not installed: say which extra, not a traceback
        print(f"hedgerow: {missing}", file=sys.stderr)
        return 1
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The whole command; options unset on the command line come from ``environ``
    (default ``os.environ``) as ``hedgerow.cli_env`` says."""
    parser = argparse.ArgumentParser(prog="hedgerow", description=__doc__,
                                     epilog="Every option can also be set as an environment "
                                            "variable, named in its help: see docs/operations.md.")
    parser.add_argument("--version", action="version", version=f"hedgerow {_version()}")
    parser.add_argument("--log-level", default="info",
                        help="debug, info, warning or error (default info)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="json: one JSON object a line, with request_id (default text)")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_up(commands)
    _add_control_plane(commands)
    _add_gateway(commands)
    _add_worker(commands)
    _add_bench(commands)
    _add_policy(commands)
    _add_cache(commands)
    apply_environment(parser, os.environ if environ is None else environ)
    return parser


def _version() -> str:
    """The installed package's version (pyproject.toml), not a second copy of it."""
    try:
        return importlib.metadata.version("hedgerow")
    except importlib.metadata.PackageNotFoundError:  # run from a bare checkout
        return "unknown (not installed)"


def _add_bench(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = commands.add_parser("bench", help="benchmarks (load generator and scenarios)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    scenario = kinds.add_parser("scenario", help="run a named scenario; last line is JSON")
    scenario.add_argument("name", help="overhead | internal-tls | overload | stragglers | throughput | "
                          "worker | pops | cache | soak | attacks | memory | processes")
    scenario.add_argument("--quick", action="store_true", help="short run (under 3 minutes; pops: under 5)")
    scenario.add_argument("--workdir", type=Path, help="keep logs and policies here")
    scenario.add_argument("--duration", type=float, help="soak only: seconds of load (default 60)")
    scenario.set_defaults(run=_run_bench_scenario)
    run = kinds.add_parser("run", help="drive any OpenAI-compatible URL; last line is JSON")
    run.add_argument("url", help="base URL, e.g. https://127.0.0.1:8443")
    run.add_argument("--model", default="smollm2-135m-instruct",
                     help="model name sent in each request (default smollm2-135m-instruct)")
    run.add_argument("--prompt", default="Say hello in five words.",
                     help="the user message of every request")
    run.add_argument("--max-tokens", type=int, default=32,
                     help="max_tokens of every request (default 32)")
    run.add_argument("--http", choices=("1.1", "2", "3"), default="1.1",
                     help="HTTP version to drive the URL with (default 1.1)")
    run.add_argument("--cacert", type=Path, help="CA to trust (e.g. .hedgerow/tls/ca.pem)")
    run.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    shape = run.add_mutually_exclusive_group(required=True)
    shape.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    shape.add_argument("--concurrency", type=int, help="closed loop: users back to back")
    run.add_argument("--duration", type=float, help="seconds of load")
    run.add_argument("--count", type=int, help="requests in all")
    run.add_argument("--out", type=Path, help="write summary.json, summary.md, records.json and PNG plots here")
    run.set_defaults(run=_run_bench_run)


def _run_bench_run(args: argparse.Namespace) -> None:
    import orjson

    from bench.run import RunOptions, run_bench

    summary = run_bench(RunOptions(
        url=args.url, model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
        http_version=args.http, ca_file=args.cacert, api_key=args.api_key, rate=args.rate,
        concurrency=args.concurrency, duration_s=args.duration, count=args.count, out=args.out))
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")


def _run_bench_scenario(args: argparse.Namespace) -> None:
    import orjson

    from bench.scenarios import run_scenario

    result = run_scenario(args.name, args.quick, args.workdir, duration_s=args.duration)
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


def _add_up(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = commands.add_parser("up", help="control plane, gateway and a CPU worker, supervised")
    up.add_argument("--host", default="127.0.0.1",
                    help="address every process serves on (default 127.0.0.1)")
    up.add_argument("--port", type=int, default=8443, help="gateway port (TCP and UDP)")
    up.add_argument("--control-plane-port", type=int, default=8500,
                    help="the control plane's port (default 8500)")
    up.add_argument("--admin-port", type=int, default=None, metavar="N",
                    help="the control plane's admin API on https://127.0.0.1:N only "
                         "(default: on --control-plane-port)")
    up.add_argument("--state-dir", type=Path, default=Path(".hedgerow"),
                    help="certificates, identities and logs of the stack (default .hedgerow)")
    up.add_argument("--slots", type=int, default=1,
                    help="the CPU worker's concurrent generations (default 1)")
    up.add_argument("--model-path", type=Path,
                    help="GGUF file for the worker (default: bundled SmolLM2)")
    up.add_argument("--policy", type=Path, help="initial policy (default: the shipped one)")
    up.add_argument("--policy-dir", type=Path,
                    help="watched directory: a changed *.yaml there becomes the policy")
    up.add_argument("--join-port", type=int, default=8501,
                    help="the control plane's join API (default 8501)")
    up.set_defaults(run=_run_up)


def _add_control_plane(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cp = commands.add_parser("control-plane", help="worker registry and watch stream")
    cp.add_argument("--host", default="127.0.0.1",
                    help="address to serve the worker and gateway API on (default 127.0.0.1)")
    cp.add_argument("--port", type=int, default=8500,
                    help="port of the worker and gateway API (mutual TLS; default 8500)")
    cp.add_argument("--lease-s", type=float, default=3.0, help="drop workers silent this long")
    cp.add_argument("--policy", type=Path, help="initial policy YAML (default: the shipped one)")
    cp.add_argument("--policy-dir", type=Path,
                    help="watched directory: a changed *.yaml file there is applied")
    cp.add_argument("--admin-token-file", type=Path,
                    help="admin API token (default $HEDGEROW_ADMIN_TOKEN; a second factor beside the admin certificate)")
    cp.add_argument("--metrics-token-file", type=Path,
                    help="read-only token for GET /metrics, which is served with the admin "
                         "API (default $HEDGEROW_METRICS_TOKEN; none: the admin token)")
    cp.add_argument("--admin-port", type=int, default=None, metavar="N",
                    help="serve the admin API (status, policy, upstreams) and /metrics on "
                         "https://ADMIN-HOST:N only, not on --port (default: on --port)")
    cp.add_argument("--admin-host", default="127.0.0.1",
                    help="admin API address with --admin-port (default 127.0.0.1; "
                         "with --insecure-internal, loopback only without a token)")
    _add_redis_options(cp, "share registry and policy with other replicas through this Redis "
                           "(rediss://USER:PASSWORD@HOST:PORT/DB; default $HEDGEROW_REDIS_URL; "
                           "none: in-process)")
    cp.add_argument("--state-dir", type=Path, default=Path(".hedgerow/control-plane"),
                    help="the cluster CA, join tokens, its own certificate and an admin "
                         "credential (STATE-DIR/admin) live here")
    cp.add_argument("--join-port", type=int, default=8501,
                    help="the join API (TLS, no client certificate): joiners buy their "
                         "certificate here with a join token (default 8501)")
    cp.add_argument("--ca-cert", type=Path, help="your own issuing CA certificate (PEM)")
    cp.add_argument("--ca-key", type=Path, help="its private key (PEM)")
    cp.add_argument("--cert-ttl-s", type=float, default=3600.0,
                    help="lifetime of the certificates it issues to workers and gateways "
                         "(default 3600; they renew at two thirds)")
    cp.add_argument("--tls-san", action="append", default=[], metavar="NAME",
                    help="another DNS name or IP clients reach it by (repeatable)")
    cp.add_argument("--insecure-internal", action="store_true",
                    help="DEBUG ONLY: plain HTTP, and every caller believed")
    add_listener_limit_options(cp)
    cp.set_defaults(run=_run_control_plane)


def _add_redis_options(parser: argparse.ArgumentParser, redis_help: str) -> None:
    from hedgerow.redis_conn import CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV

    def env_path(name: str) -> Path | None:
        return Path(os.environ[name]) if os.environ.get(name) else None

    # The URL carries the ACL user's password: $HEDGEROW_REDIS_URL keeps it out
    # of the process list, where --redis would show it to every local user.
    parser.add_argument("--redis", metavar="URL", default=os.environ.get("HEDGEROW_REDIS_URL"),
                        help=redis_help)
    parser.add_argument("--redis-ca-file", type=Path, metavar="PEM", default=env_path(CA_FILE_ENV),
                        help="CA that signed the Redis server's certificate, for rediss:// "
                             f"(default ${CA_FILE_ENV}; none: the system's CAs)")
    parser.add_argument("--redis-cert-file", type=Path, metavar="PEM",
                        default=env_path(CERT_FILE_ENV),
                        help="client certificate, for a Redis with tls-auth-clients yes "
                             f"(default ${CERT_FILE_ENV})")
    parser.add_argument("--redis-key-file", type=Path, metavar="PEM",
                        default=env_path(KEY_FILE_ENV),
                        help=f"the client certificate's key (default ${KEY_FILE_ENV})")


def _redis_tls(args: argparse.Namespace) -> RedisTls:
    from hedgerow.redis_conn import RedisTls

    return RedisTls(args.redis_ca_file, args.redis_cert_file, args.redis_key_file)


def _run_reporting_setup_errors(run: Callable[[], None]) -> int:
    """``run()``; a ``RedisSetupError`` (wrong CA, password, ACL), a ``CaError`` (an
    unusable CA or state directory) or an ``UntestedHttpStack`` (a hypercorn,
    aioquic or h2 other than the pinned one) ends it with its message and exit
    status 1 rather than a traceback."""
    from hedgerow.http_stack import UntestedHttpStack
    from hedgerow.redis_conn import RedisSetupError
    from hedgerow.trust.ca import CaError

    try:
        run()
    except (RedisSetupError, CaError, UntestedHttpStack, BaseExceptionGroup) as error:
        problem = (_setup_error(error, RedisSetupError) or _setup_error(error, CaError)
                   or _setup_error(error, UntestedHttpStack))
        if problem is None:
            raise
        logging.getLogger("hedgerow").error("cannot start: %s", problem)
        return 1
    return 0


def _setup_error(error: BaseException, kind: type[Exception]) -> Exception | None:
    """``error`` if it is a ``kind``, or the first ``kind`` inside an exception group."""
    if isinstance(error, kind):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _setup_error(inner, kind)
            if found is not None:
                return found
    return None


def _add_policy(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from hedgerow.policy_cli import add_policy_parser, add_status_parser

    add_policy_parser(commands)
    add_status_parser(commands)
    from hedgerow.trust_cli import add_trust_parsers

    add_trust_parsers(commands)
    from hedgerow.key_cli import add_key_parsers

    add_key_parsers(commands)


def _add_gateway(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gw = commands.add_parser("gateway", help="the client-facing gateway (h1, h2, h3)")
    gw.add_argument("--host", action="append",
                    help="address to serve on, TCP and UDP; repeat for several "
                         "(default: 127.0.0.1 and ::1, so https://localhost works in browsers)")
    gw.add_argument("--port", type=int, default=8443,
                    help="client port, TCP (h1, h2) and UDP (h3) (default 8443)")
    gw.add_argument("--control-plane", default=DEFAULT_CONTROL_PLANE,
                    help=f"the control plane's URL (default {DEFAULT_CONTROL_PLANE})")
    gw.add_argument("--state-dir", type=Path, default=Path(".hedgerow"),
                    help="development certificate, identity and ticket keys (default .hedgerow)")
    gw.add_argument("--certfile", type=Path, help="production certificate (PEM)")
    gw.add_argument("--keyfile", type=Path, help="production private key (PEM)")
    gw.add_argument("--policy", type=Path,
                    help="pin this local policy YAML (default: follow the control plane's)")
    gw.add_argument("--gateway-id", help="name in `hedgerow status` (default: gw-HOST-PORT)")
    gw.add_argument("--pop", default=os.environ.get("HEDGEROW_POP"),
                    help="this gateway's PoP: prefer workers labelled pop=NAME, spill to "
                         "others per the policy's topology (default $HEDGEROW_POP; none: off)")
    gw.add_argument("--drain-timeout-s", type=float, default=30.0,
                    help="on SIGTERM, how long in-flight streams may finish before they "
                         "are ended with an error event (default 30)")
    _add_redis_options(gw, "share tenants' requests/s and tokens/min limits and the response "
                           "cache with the other gateways on this Redis "
                           "(rediss://USER:PASSWORD@HOST:PORT/DB; default $HEDGEROW_REDIS_URL; "
                           "none: per gateway)")
    gw.add_argument("--admin-port", type=int, default=None, metavar="N",
                    help="serve the admin API (cache purge, stats) and /metrics on "
                         "https://ADMIN-HOST:N (mutual TLS, role admin), never on --port "
                         "(default: off)")
    gw.add_argument("--admin-host", default="127.0.0.1",
                    help="admin API address (default 127.0.0.1; with --insecure-internal, "
                         "loopback only without a token)")
    gw.add_argument("--admin-token-file", type=Path,
                    help="admin API token (default $HEDGEROW_ADMIN_TOKEN; a second factor beside the admin certificate)")
    gw.add_argument("--metrics-token-file", type=Path,
                    help="read-only token for GET /metrics on the admin port "
                         "(default $HEDGEROW_METRICS_TOKEN; none: the admin token)")
    gw.add_argument("--max-connections", type=int, default=4096, metavar="N",
                    help="open connections (TCP and QUIC) at most; beyond it new ones are "
                         "refused before TLS (default 4096; the open-file limit is raised "
                         "to fit, or the cap lowered)")
    _add_quic_limits(gw)
    gw.add_argument("--max-requests-per-connection", type=int, default=10_000, metavar="N",
                    help="requests on one connection; then HTTP/1.1 closes after the reply "
                         "and HTTP/2 drains gracefully (GOAWAY, streams in flight finish) "
                         "(default 10000)")
    gw.add_argument("--h2-limit", action="append", default=[], metavar="NAME=VALUE",
                    help="override one per-connection HTTP/2 flood budget, e.g. "
                         "pings_per_s=20 (repeatable; names and defaults: docs/security.md, "
                         "'Front door: HTTP/2')")
    from hedgerow.source_limits import BURST_S, SourceLimitsConfig  # light: no I/O, no deps

    limits = SourceLimitsConfig()
    gw.add_argument("--max-connections-per-ip", type=int, default=limits.max_open_per_ip,
                    metavar="N", help="open connections (TCP and QUIC together) from one client "
                    f"IP at most; beyond it new ones are closed before TLS (default {limits.max_open_per_ip}; "
                    "0: no limit)")
    gw.add_argument("--max-connections-per-prefix", type=int,
                    default=limits.max_open_per_prefix, metavar="N",
                    help="the same for one /24 (IPv4) or /64 (IPv6) "
                         f"(default {limits.max_open_per_prefix}; 0: no limit)")
    gw.add_argument("--new-connections-per-ip", type=float, default=limits.rate_per_ip,
                    metavar="PER_S", help="new connections per second (TCP and QUIC together) "
                    "from one client IP, "
                    f"with a burst of {BURST_S:g} s worth; beyond it they are closed before TLS "
                    f"(default {limits.rate_per_ip:g}; 0: no limit)")
    gw.add_argument("--new-connections-per-prefix", type=float,
                    default=limits.rate_per_prefix, metavar="PER_S",
                    help="the same for one /24 (IPv4) or /64 (IPv6) "
                         f"(default {limits.rate_per_prefix:g}; 0: no limit)")
    gw.add_argument("--connection-limits-exempt", default=",".join(limits.exempt),
                    metavar="CIDR,...", help="client networks the per-client limits never "
                    "apply to (default: loopback, " + ",".join(limits.exempt) + "; "
                    "'none': no exemption). A reverse proxy in front makes every client "
                    "its address: exempt it, or limit at the proxy")
    gw.add_argument("--certificate-poll-s", type=float, default=5.0, metavar="S",
                    help="check --certfile/--keyfile for a change this often and load a "
                         "changed pair without dropping connections (default 5; 0: only on "
                         "SIGHUP, which always reloads)")
    gw.add_argument("--http1", choices=("native", "hypercorn"), default="native",
                    help="who serves HTTP/1.1 clients on --port: native (default; hedgerow.h1: "
                         "llhttp and an asyncio protocol; its listener spends about half the CPU "
                         "per request of h11's) or hypercorn (h11); HTTP/2 and HTTP/3 are "
                         "hypercorn's either way")
    gw.add_argument("--tls-ticket-rotation-s", type=float, default=3600.0, metavar="S",
                    help="rotate the TLS session ticket keys (TCP) and retire QUIC tickets "
                         "this often; a ticket resumes during its period and the next "
                         "(default 3600)")
    gw.add_argument("--max-buffered-body-bytes", type=int, default=64 * 1024 * 1024,
                    metavar="N", help="request body bytes being received at once, all "
                    "requests together; a body that does not fit gets a 503 at once "
                    "(default 67108864: 64 MiB)")
    gw.add_argument("--access-log", default="stderr", metavar="stderr|off|PATH",
                    help="one JSON line per completion request (no prompt, no key): to "
                         "stderr, off, or appended to PATH (default stderr; fields: "
                         "docs/operations.md, 'Access log')")
    gw.add_argument("--processes", type=int, default=None, metavar="N",
                    help="gateway processes serving --port together (SO_REUSEPORT, TCP and "
                         "UDP; QUIC steered by connection id); they share nothing in memory, "
                         "so limits and cache are per process without --redis; the admin "
                         "listener of process i is on --admin-port + i (default: the cores "
                         "this process may run on; 1: one process, no supervisor)")
    add_trust_arguments(gw)
    gw.set_defaults(run=_run_gateway)


def _add_quic_limits(gw: argparse.ArgumentParser) -> None:
    from gateway.edge.quic_admission import RETRY_MODES, QuicLimits

    d = QuicLimits()
    quic = gw.add_argument_group("QUIC / HTTP/3 limits (docs/security.md)")
    quic.add_argument("--quic-retry", choices=RETRY_MODES, default=d.retry,
                      help="answer new QUIC clients with a Retry (address validation): "
                           "auto (while --quic-retry-above handshakes are pending), always, "
                           f"never (default {d.retry})")
    for flag, name, kind, help_text in (
        ("--quic-retry-above", "retry_above_half_open", int,
         "pending handshakes from which auto sends Retries"),
        ("--quic-max-half-open", "max_half_open", int,
         "QUIC connections with the handshake not done, at most; beyond, Initials are dropped"),
        ("--quic-max-half-open-per-source", "max_half_open_per_source", int,
         "the same, from one IPv4 address or IPv6 /64"),
        ("--quic-handshake-timeout-s", "handshake_timeout_s", float,
         "a QUIC handshake not done within this is closed"),
        ("--quic-token-lifetime-s", "token_lifetime_s", float,
         "a Retry token is accepted for this long, from the address it was sent to"),
        ("--quic-max-data-bytes", "max_data_bytes", int,
         "QUIC flow-control window of a connection"),
        ("--quic-max-stream-data-bytes", "max_stream_data_bytes", int,
         "QUIC flow-control window of a stream"),
        ("--h3-max-field-section-bytes", "h3_max_field_section_bytes", int,
         "an HTTP/3 request whose header section is larger than this is answered 431"),
        ("--h3-max-refused-header-sections", "h3_max_refused_header_sections", int,
         "past this many such requests on one connection it is closed (H3_EXCESSIVE_LOAD)"),
        ("--h3-qpack-table-bytes", "h3_qpack_table_bytes", int,
         "QPACK dynamic table offered to clients (0: none, so no header inflation)"),
        ("--h3-qpack-blocked-streams", "h3_qpack_blocked_streams", int,
         "streams that may wait on QPACK table updates (with a table)"),
    ):
        quic.add_argument(flag, dest=f"quic_{name}", type=kind, default=getattr(d, name),
                          metavar="N", help=f"{help_text} (default {getattr(d, name)})")


def _quic_limits(args: argparse.Namespace) -> QuicLimits:
    from dataclasses import fields

    from gateway.edge.quic_admission import QuicLimits

    return QuicLimits(**{f.name: getattr(args, f"quic_{f.name}") for f in fields(QuicLimits)})


def _add_cache(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cache = commands.add_parser("cache", help="a gateway's response cache (its admin API)")
    kinds = cache.add_subparsers(dest="cache_command", required=True)
    for name, help_text in (("purge", "remove cached answers by tenant, model or key"),
                            ("stats", "the cache's counters and entries")):
        kind = kinds.add_parser(name, help=help_text)
        kind.add_argument("--gateway-admin", metavar="URL", default="https://127.0.0.1:8444",
                          help="the gateway's admin API (its --admin-port; default "
                               "https://127.0.0.1:8444)")
        kind.add_argument("--admin-token-file", type=Path,
                          help="admin token (default $HEDGEROW_ADMIN_TOKEN)")
        kind.add_argument("--admin-identity", type=Path, default=Path(os.environ.get(
            "HEDGEROW_ADMIN_IDENTITY", ".hedgerow/control-plane/admin")),
            help="the admin credential (default $HEDGEROW_ADMIN_IDENTITY or %(default)s)")
        kind.set_defaults(run=_run_cache)
        if name == "purge":
            kind.add_argument("--tenant", help="the tenant's own namespace")
            kind.add_argument("--model", help="a model name or alias")
            kind.add_argument("--key", help="one exact key")
    export = kinds.add_parser(
        "export-model", help="export the semantic cache's embedding model to ONNX and train "
                             "its pair model, once (needs hedgerow[export]; the gateway runs "
                             "both without torch)")
    export.add_argument("--force", action="store_true",
                        help="export (and train) again even if an export of the same weights, "
                             "training pairs and recipe is there")
    export.set_defaults(run=_run_export_model)


def _run_export_model(args: argparse.Namespace) -> int:
    from gateway.cache.onnx_export import export_model
    from gateway.cache.pair_export import export_pair_model

    for export in (export_model, export_pair_model):
        try:
            directory, exported = export(force=args.force)
        except (ImportError, OSError, RuntimeError) as error:
            print(f"hedgerow cache export-model: {error}", file=sys.stderr)
            return 1
        print(f"{'exported to' if exported else 'up to date:'} {directory}")
    return 0


def _run_cache(args: argparse.Namespace) -> int:
    import httpx
    import orjson

    from hedgerow.admin_token import read_admin_token
    from gateway.admin.api import purge

    try:
        token = read_admin_token(args.admin_token_file)
        verify = _gateway_admin_tls(args)
        if args.cache_command == "purge":
            if not (args.tenant or args.model or args.key):
                print("hedgerow cache purge: give --tenant, --model or --key", file=sys.stderr)
                return 2
            result = purge(args.gateway_admin, token, tenant=args.tenant, model=args.model,
                           key=args.key, verify=verify)
        else:
            reply = httpx.get(args.gateway_admin.rstrip("/") + "/admin/cache", timeout=10,
                              headers={"authorization": f"Bearer {token}"} if token else {},
                              verify=verify)
            reply.raise_for_status()
            result = reply.json()
    except (OSError, ValueError, httpx.HTTPError) as error:
        print(f"hedgerow cache {args.cache_command}: {error}", file=sys.stderr)
        return 1
    print(orjson.dumps(result).decode())
    return 0


def _gateway_admin_tls(args: argparse.Namespace) -> ssl.SSLContext | bool:
    """The admin credential for a gateway's https:// admin listener. A gateway's
    certificate names its identity, not a host: the chain is checked, not the name."""
    if not args.gateway_admin.startswith("https:"):
        return True
    from hedgerow.trust.credentials import Credentials, TlsContexts

    return TlsContexts(Credentials(args.admin_identity)).client(check_hostname=False)


def _add_worker(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    wk = commands.add_parser("worker", help="a llama.cpp model worker")
    wk.add_argument("--host", default="127.0.0.1",
                    help="address to serve gateways on (default 127.0.0.1)")
    wk.add_argument("--port", type=int, default=0, help="0 picks a free port")
    wk.add_argument("--advertise-host", help="host the gateway should dial (default --host)")
    wk.add_argument("--control-plane", default=DEFAULT_CONTROL_PLANE,
                    help=f"the control plane's URL (default {DEFAULT_CONTROL_PLANE})")
    wk.add_argument("--worker-id", help="its identity's name too (default: KIND-HOST-RANDOM)")
    wk.add_argument("--state-dir", type=Path, default=Path(".hedgerow"),
                    help="its identity lives in STATE-DIR/identity-worker-ID by default")
    wk.add_argument("--model-path", type=Path, help="any GGUF file (default: bundled SmolLM2)")
    wk.add_argument("--model-name", help="name clients use (default: from the file name)")
    wk.add_argument("--slots", type=int, default=None,
                    help="model instances = concurrent requests (default: 4 on a GPU, 1 on the CPU)")
    wk.add_argument("--n-ctx", type=int, default=2048,
                    help="context window in tokens, prompt and answer (default 2048)")
    wk.add_argument("--n-gpu-layers", type=int, default=None,
                    help="layers to offload (default: all on a usable GPU, else 0)")
    wk.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                    help="e.g. --label pop=ams --label region=eu")
    wk.add_argument("--drain-timeout-s", type=float, default=30.0,
                    help="on SIGTERM, how long running generations may finish (default 30)")
    wk.add_argument("--quant", help="serve the bundled model in this GGUF quantization, made "
                    "locally once from the bundled Q4_1 (e.g. q8_0, q4_0; default: q4_1)")
    wk.add_argument("--tier", help="advertise this quantization tier (label tier=NAME); the "
                    "policy's classes pick tiers, e.g. fast / accurate")
    wk.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                    help="prompt-lookup speculative decoding drafting N tokens (0: off); for "
                         "answers that copy their input: extraction, editing, code")
    wk.add_argument("--no-prompt-reuse", dest="prompt_reuse", action="store_false",
                    help="evaluate every prompt in full (for comparisons)")
    wk.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                    help="register without the warm-up generation")
    wk.add_argument("--backend", choices=("llama", "sim"), default="llama",
                    help="sim: a simulated model for benchmarks and tests, never for users")
    _add_sim_options(wk)
    add_trust_arguments(wk)
    wk.set_defaults(run=_run_worker)


def _add_sim_options(wk: argparse.ArgumentParser) -> None:
    from workers.sim_backend import LatencyModel as Sim

    group = wk.add_argument_group("simulated backend (--backend sim; --model-name, --slots apply)")
    for flag, default, help_text in [
        ("--sim-prefill-ms-per-token", Sim.prefill_ms_per_token, "time to first token per prompt token"),
        ("--sim-decode-ms-per-token", Sim.decode_ms_per_token, "time per further token"),
        ("--sim-jitter", Sim.jitter, "each sleep times uniform [1-j, 1+j]"),
        ("--sim-straggler-prob", Sim.straggler_probability, "fraction of requests slowed down"),
        ("--sim-straggler-factor", Sim.straggler_factor, "how much slower a straggler is"),
        ("--sim-fail-prob", Sim.failure_probability, "fail with a 500 before the first token"),
        ("--sim-midstream-fail-prob", Sim.mid_stream_failure_probability, "break the stream mid-way"),
    ]:
        group.add_argument(flag, type=float, default=default, help=f"{help_text} (default {default})")
    group.add_argument("--sim-output-tokens", type=int, default=Sim.output_tokens,
                       help="tokens when a request sets no max_tokens")
    group.add_argument("--sim-seed", type=int, help="seed for reproducible runs")
    group.add_argument("--sim-embedding-model", metavar="NAME",
                       help="also serve a simulated embedding model NAME at /v1/embeddings")
    group.add_argument("--sim-slow-periods", metavar="PROB:SECONDS:FACTOR",
                       help="correlated stragglers: each SECONDS-long window of wall-clock time "
                            "is slow (every sleep x FACTOR) with probability PROB, drawn from "
                            "--sim-seed, so workers given one seed are slow together")


def _labels(pairs: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"hedgerow: --label wants KEY=VALUE, got {pair!r}")
        labels[key] = value
    return labels


@contextmanager
def traced(service_name: str) -> Iterator[None]:
    """Tracing for the process, when its environment asks for it (``hedgerow.tracing``);
    what is batched is flushed as it ends."""
    tracing.setup(service_name)
    try:
        yield
    finally:
        tracing.shutdown()


def run_until_signalled(body: Callable[[anyio.Event], Awaitable[None]], *,
                        keep_watching: bool = False) -> None:
    """Run ``body(shutdown)``; the first SIGINT/SIGTERM sets ``shutdown``.
    ``keep_watching``: later ones are absorbed rather than left to kill the
    process (a gateway child gets SIGTERM from its supervisor and, under
    systemd or a terminal's Ctrl-C, directly too: it must drain, not die)."""

    async def runner() -> None:
        shutdown = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        if shutdown.is_set():
                            continue
                        logging.getLogger("hedgerow").info(
                            "%s: shutting down gracefully", signal.Signals(signum).name)
                        shutdown.set()
                        if not keep_watching:
                            return

            tg.start_soon(watch_signals)
            await body(shutdown)
            tg.cancel_scope.cancel()

    # uvloop: a faster event loop for every process kind (a dependency on Linux).
    anyio.run(runner, backend_options={"use_uvloop": True})


def _run_control_plane(args: argparse.Namespace) -> int:
    from control_plane.main import run_control_plane
    from hedgerow.policy_cli import check_startup_policy
    from policies.schema import DEFAULT_POLICY_PATH

    from hedgerow.admin_token import read_admin_token, read_metrics_token

    policy_file = args.policy or DEFAULT_POLICY_PATH
    problem = check_startup_policy(policy_file, args.policy_dir)
    if problem is not None:
        print(f"hedgerow: {problem}", file=sys.stderr)
        return 1
    if args.admin_port is not None and args.admin_port == args.port != 0:
        print("hedgerow: --admin-port must differ from --port", file=sys.stderr)
        return 2
    try:
        admin_token = read_admin_token(args.admin_token_file)
        metrics_token = read_metrics_token(args.metrics_token_file)
    except (OSError, ValueError) as error:
        print(f"hedgerow: cannot use the token: {error}", file=sys.stderr)
        return 1
    from control_plane.main import TrustOptions

    if (args.ca_cert is None) != (args.ca_key is None):
        print("hedgerow: --ca-cert and --ca-key go together", file=sys.stderr)
        return 2
    trust = TrustOptions(state_dir=args.state_dir, join_port=args.join_port,
                         ca_cert=args.ca_cert, ca_key=args.ca_key, cert_ttl_s=args.cert_ttl_s,
                         tls_sans=tuple(args.tls_san), insecure=args.insecure_internal)
    from hedgerow.cli_flags import listener_limits

    try:
        internal_limits, join_limits = listener_limits(
            args, _networks(args.connection_limits_exempt))
    except ValueError as error:
        print(f"hedgerow: connection limits: {error}", file=sys.stderr)
        return 2
    return _run_reporting_setup_errors(lambda: run_until_signalled(
        lambda shutdown: run_control_plane(
            args.host, args.port, shutdown, trust_options=trust, lease_s=args.lease_s,
            policy_file=policy_file, policy_dir=args.policy_dir, admin_token=admin_token,
            metrics_token=metrics_token, redis_url=args.redis, redis_tls=_redis_tls(args), admin_port=args.admin_port,
            admin_host=args.admin_host, internal_limits=internal_limits,
            join_limits=join_limits)))


def _run_gateway(args: argparse.Namespace) -> int:
    from hedgerow.admin_token import read_admin_token, read_metrics_token
    from gateway.main import GatewayOptions, run_gateway
    from gateway.edge.transport import local_hosts

    try:
        admin_token = read_admin_token(args.admin_token_file)
        metrics_token = read_metrics_token(args.metrics_token_file)
    except (OSError, ValueError) as error:
        print(f"hedgerow: cannot use the token: {error}", file=sys.stderr)
        return 1
    if args.max_connections < 1:
        print("hedgerow: --max-connections must be at least 1", file=sys.stderr)
        return 1
    try:
        quic_limits = _quic_limits(args)
    except ValueError as error:
        print(f"hedgerow: QUIC limits: {error}", file=sys.stderr)
        return 1
    if args.max_requests_per_connection < 1:
        print("hedgerow: --max-requests-per-connection must be at least 1", file=sys.stderr)
        return 1
    from gateway.edge.processes import ChildSlot, default_processes

    child = ChildSlot.from_env()
    processes = default_processes() if args.processes is None else args.processes
    if not 1 <= processes <= 256:
        print("hedgerow: --processes must be 1 to 256", file=sys.stderr)
        return 1
    problem = _admin_ports_problem(args.admin_port, args.port, processes)
    if problem is not None:
        print(f"hedgerow: {problem}", file=sys.stderr)
        return 1
    from gateway.edge.h2_budget import parse_h2_limits
    if not 0 < args.tls_ticket_rotation_s < float("inf"):
        print("hedgerow: --tls-ticket-rotation-s must be a positive number", file=sys.stderr)
        return 1
    if args.max_buffered_body_bytes < 1:
        print("hedgerow: --max-buffered-body-bytes must be at least 1", file=sys.stderr)
        return 1
    if not args.certificate_poll_s >= 0:
        print("hedgerow: --certificate-poll-s must be 0 or more", file=sys.stderr)
        return 1
    from hedgerow.source_limits import SourceLimitsConfig

    try:
        source_limits = SourceLimitsConfig(
            max_open_per_ip=args.max_connections_per_ip,
            max_open_per_prefix=args.max_connections_per_prefix,
            rate_per_ip=args.new_connections_per_ip,
            rate_per_prefix=args.new_connections_per_prefix,
            exempt=_networks(args.connection_limits_exempt))
    except ValueError as error:
        print(f"hedgerow: per-client connection limits: {error}", file=sys.stderr)
        return 1
    from gateway.main import default_gateway_id

    try:
        h2_limits = parse_h2_limits(args.h2_limit)
    except ValueError as error:
        print(f"hedgerow: --h2-limit: {error}", file=sys.stderr)
        return 1

    from gateway.admin.access_log import configure_access_log

    try:
        configure_access_log(args.access_log)
    except OSError as error:
        print(f"hedgerow: --access-log: {error}", file=sys.stderr)
        return 1
    gateway_id = args.gateway_id or default_gateway_id(args.port)
    tls = _internal_tls(args, "gateway", gateway_id, args.control_plane, args.state_dir)
    if tls is None:
        return 1
    options = GatewayOptions(
        control_plane=args.control_plane, host=tuple(args.host or local_hosts()), port=args.port,
        state_dir=args.state_dir, certfile=args.certfile, keyfile=args.keyfile,
        policy_path=args.policy, gateway_id=gateway_id, internal_tls=tls,
        drain_timeout_s=args.drain_timeout_s, redis_url=args.redis,
        redis_tls=_redis_tls(args), pop=args.pop,
        admin_port=args.admin_port, admin_host=args.admin_host, admin_token=admin_token,
        metrics_token=metrics_token, max_connections=args.max_connections,
        quic=quic_limits,
        max_requests_per_connection=args.max_requests_per_connection, h2_limits=h2_limits,
        source_limits=source_limits, certificate_poll_s=args.certificate_poll_s,
        ticket_rotation_s=args.tls_ticket_rotation_s, native_http1=args.http1 == "native",
        tune_gc=True,
        max_buffered_body_bytes=args.max_buffered_body_bytes,
    )
    if child is not None:
        return _run_gateway_child(options, child)
    if processes > 1:
        supervised = _supervise_gateways(args, options, processes)
        if supervised is not None:
            return supervised
    with traced("hedgerow-gateway"):
        return _run_reporting_setup_errors(
            lambda: run_until_signalled(lambda shutdown: run_gateway(options, shutdown)))


def _admin_ports_problem(admin_port: int | None, port: int, processes: int) -> str | None:
    """Process i's admin listener is on admin_port + i: the whole range must be
    ports, and clear of the public port (which every process binds too)."""
    if admin_port is None or admin_port == 0:
        return None
    last = admin_port + processes - 1
    if last > 65535:
        return (f"--admin-port {admin_port} with --processes {processes} needs ports up to "
                f"{last}; the last port is 65535")
    if port != 0 and admin_port <= port <= last:
        return (f"--port {port} is in the admin ports of --processes {processes} "
                f"(--admin-port {admin_port}..{last}, process i on --admin-port + i)")
    return None


def _supervise_gateways(args: argparse.Namespace, options: GatewayOptions,
                        processes: int) -> int | None:
    """``--processes N``: bind the port's sockets, start and watch N children.

    None: serve as one process instead (N was the default, not asked for, and
    this kernel cannot steer QUIC datagrams between processes)."""
    from gateway.edge.devcert import ensure_dev_certificate
    from gateway.edge.processes import SteeringUnavailable, Supervisor, bind_groups

    if options.certfile is None or options.keyfile is None:
        ensure_dev_certificate(options.state_dir)  # once, before the children race for it
    hosts = [options.host] if isinstance(options.host, str) else list(options.host)
    try:
        groups = bind_groups(hosts, options.port, processes)
    except SteeringUnavailable as error:
        if args.processes is None:  # the default, not a request: still serve
            logging.getLogger("hedgerow.gateway").warning(
                "serving as one process, not %d: %s", processes, error)
            return None
        print(f"hedgerow: --processes {processes}: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"hedgerow: cannot bind port {options.port}: {error}", file=sys.stderr)
        return 1
    if options.redis_url is None:
        logging.getLogger("hedgerow.gateway").warning(
            "%d gateway processes without --redis: each applies tenants' limits and keeps "
            "a response cache of its own", processes)
    from gateway.cache.shared_embedder import SharedSidecar

    # One embedding sidecar for all the processes, started when one of them wants it.
    supervisor = Supervisor(getattr(args, "argv", sys.argv[1:]), groups, processes,
                            drain_timeout_s=options.drain_timeout_s, sidecar=SharedSidecar())
    return supervisor.run()


def _run_gateway_child(options: GatewayOptions, child: ChildSlot) -> int:
    """One of ``--processes N``: serve the inherited sockets, tell the parent when up."""
    from gateway.main import ProcessSlot, run_gateway
    from gateway.edge.processes import CHILD_ENV, die_with_parent
    from gateway.edge.transport import Listeners
    from hedgerow.http_stack.quic_cid import install_cid_steering

    os.environ.pop(CHILD_ENV, None)  # nothing this process starts is a gateway child
    die_with_parent()
    tcp, udp = child.sockets()
    install_cid_steering(child.index, child.count)
    options = dataclasses.replace(
        options, port=child.port,
        process=ProcessSlot(child.index, child.count, Listeners(child.port, tcp, udp),
                            embed_socket=Path(child.embed_socket) if child.embed_socket else None,
                            want_embedder=child.want_embedder))

    async def body(shutdown: anyio.Event) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(run_gateway, options, shutdown)
            child.announce_ready()

    with traced("hedgerow-gateway"):
        return _run_reporting_setup_errors(lambda: run_until_signalled(body, keep_watching=True))


def _networks(text: str) -> tuple[str, ...]:
    """A comma-separated list of networks; "none" (or nothing): an empty one."""
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _run_worker(args: argparse.Namespace) -> int:
    from workers.main import (WorkerOptions, build_llama_backend, build_sim_backend,
                              default_worker_id, run_worker)

    if args.sim_embedding_model and args.backend != "sim":
        raise SystemExit("hedgerow: --sim-embedding-model is for --backend sim")
    options = WorkerOptions(
        control_plane=args.control_plane, host=args.host, port=args.port,
        advertise_host=args.advertise_host, worker_id=args.worker_id,
        model_path=args.model_path, model_name=args.model_name, slots=args.slots,
        n_ctx=args.n_ctx, n_gpu_layers=args.n_gpu_layers, labels=_labels(args.label),
        drain_timeout_s=args.drain_timeout_s, quant=args.quant, tier=args.tier,
        prompt_reuse=args.prompt_reuse, prompt_lookup_tokens=args.prompt_lookup,
        warm_up=args.warm_up,
        sim=_latency_model(args) if args.backend == "sim" else None, sim_seed=args.sim_seed,
        sim_embedding_model=args.sim_embedding_model if args.backend == "sim" else None,
        sim_slow_periods=_slow_periods(args) if args.backend == "sim" else None,
    )
    backend = build_sim_backend(options) if args.backend == "sim" else build_llama_backend(options)
    worker_id = options.worker_id or default_worker_id(backend)
    tls = _internal_tls(args, "worker", worker_id, args.control_plane, args.state_dir)
    if tls is None:
        return 1
    options = dataclasses.replace(options, worker_id=worker_id, tls=tls)
    with traced("hedgerow-worker"):
        run_until_signalled(lambda shutdown: run_worker(options, backend, shutdown))
    return 0


def _internal_tls(args: argparse.Namespace, role: str, name: str, control_plane: str,
                  state_dir: Path) -> InternalTls | None:
    """This process's identity (joining if need be); None after printing why not."""
    from hedgerow.trust.credentials import CredentialsError
    from hedgerow.trust.identity import IdentityError
    from hedgerow.trust.join import JoinError
    from hedgerow.cli_flags import internal_tls

    try:
        return internal_tls(args, role, name, control_plane, state_dir)  # type: ignore[arg-type]
    except (JoinError, CredentialsError, IdentityError, OSError) as error:
        print(f"hedgerow {role}: {error}", file=sys.stderr)
        return None


def _latency_model(args: argparse.Namespace) -> LatencyModel:
    from workers.sim_backend import LatencyModel, SlowPeriods

    try:
        return LatencyModel(
            prefill_ms_per_token=args.sim_prefill_ms_per_token,
            decode_ms_per_token=args.sim_decode_ms_per_token, jitter=args.sim_jitter,
            straggler_probability=args.sim_straggler_prob,
            straggler_factor=args.sim_straggler_factor, failure_probability=args.sim_fail_prob,
            mid_stream_failure_probability=args.sim_midstream_fail_prob,
            output_tokens=args.sim_output_tokens,
        )
    except ValueError as error:
        raise SystemExit(f"hedgerow: {error}") from error


def _slow_periods(args: argparse.Namespace) -> SlowPeriods | None:
    from workers.sim_backend import SlowPeriods

    if not args.sim_slow_periods:
        return None
    try:
        return SlowPeriods.parse(args.sim_slow_periods, args.sim_seed or 0)
    except ValueError as error:
        raise SystemExit(f"hedgerow: {error}") from error


def _run_up(args: argparse.Namespace) -> int:
    from hedgerow.launcher import Stack, run_stack

    stack = Stack(
        python=sys.executable, host=args.host, gateway_port=args.port,
        control_plane_port=args.control_plane_port, state_dir=args.state_dir,
        slots=args.slots, model_path=args.model_path, policy=args.policy,
        policy_dir=args.policy_dir, admin_port=args.admin_port, join_port=args.join_port,
    )
    return run_stack(stack)


if __name__ == "__main__":
    sys.exit(main())
