"""Flag groups that several commands share, and what each builds from parsed flags.

The command line's half of two runtime types: ``InternalTls``
(``hedgerow.trust.process``: ``--join-token``, ``--ca-file``,
``--insecure-internal``..., shared by ``hedgerow gateway`` and ``hedgerow
worker``) and ``ListenerLimits`` (``hedgerow.listener_limits``: the control
plane's ``--max-connections`` and siblings). Kept apart so that the gateway,
workers and control plane never import argparse code
(``tests/unit/test_layering.py``).

``--insecure-internal`` turns internal TLS off (plain HTTP, nothing
verified); it is never the default and it logs loudly.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
from pathlib import Path

from hedgerow.listener_limits import INTERNAL, JOIN, ListenerLimits
from hedgerow.source_limits import BURST_S, DEFAULT_EXEMPT
from hedgerow.trust.credentials import TlsContexts
from hedgerow.trust.identity import Identity, Role
from hedgerow.trust.join import JoinOptions, ensure_identity
from hedgerow.trust.process import InternalTls

log = logging.getLogger("hedgerow.trust")

TOKEN_ENV = "HEDGEROW_JOIN_TOKEN"


def add_trust_arguments(parser: argparse.ArgumentParser) -> None:
    trust = parser.add_argument_group("internal trust (mutual TLS with the control plane)")
    trust.add_argument("--join-token", metavar="TOKEN",
                       help="join token given inline (any local user can read it in `ps`: "
                            "prefer --join-token-file or $HEDGEROW_JOIN_TOKEN)")
    trust.add_argument("--join-token-file", type=Path,
                       help=f"join token (default ${TOKEN_ENV}); used once, when "
                            "--identity-dir holds no current certificate")
    trust.add_argument("--join-url", help="the control plane's join API "
                       "(default: https://CONTROL-PLANE-HOST:8501)")
    trust.add_argument("--ca-file", type=Path, help="the cluster CA certificate (PEM)")
    trust.add_argument("--ca-pin", help="sha256:HEX of the cluster CA, instead of --ca-file "
                       "(printed by `hedgerow token create`)")
    trust.add_argument("--identity-dir", type=Path,
                       help="where this process keeps its key and certificate "
                            "(default: STATE-DIR/identity-ROLE-NAME)")
    trust.add_argument("--tls-cert", type=Path, help="your own PKI: this certificate "
                       "(with a spiffe://hedgerow/ROLE/NAME URI SAN) instead of joining")
    trust.add_argument("--tls-key", type=Path, help="your own PKI: its private key")
    trust.add_argument("--insecure-internal", action="store_true",
                       help="DEBUG ONLY: plain HTTP to the control plane and between "
                            "gateways and workers; nothing is authenticated")


def internal_tls(args: argparse.Namespace, role: Role, name: str, control_plane: str,
                 state_dir: Path) -> InternalTls:
    """Join or load this process's identity as the flags say. Raises JoinError."""
    if args.insecure_internal:
        log.warning("INSECURE: --insecure-internal: this %s talks plain HTTP to the control "
                    "plane and %s; nothing it receives is authenticated. Debugging only.",
                    role, "workers" if role == "gateway" else "gateways")
        return InternalTls(None, control_plane)
    identity = Identity(role, name)
    options = JoinOptions(
        identity=identity,
        identity_dir=args.identity_dir or state_dir / f"identity-{role}-{name}",
        control_plane=control_plane, join_url=args.join_url, token=_token(args),
        ca_file=args.ca_file, ca_pin=args.ca_pin, tls_cert=args.tls_cert,
        tls_key=args.tls_key)
    creds = ensure_identity(options, datetime.datetime.now(datetime.UTC))
    return InternalTls(TlsContexts(creds), control_plane)


def _token(args: argparse.Namespace) -> str | None:
    if args.join_token:
        return str(args.join_token).strip()
    if args.join_token_file is not None:
        return str(args.join_token_file.read_text()).strip()
    return os.environ.get(TOKEN_ENV) or None


def add_listener_limit_options(parser: argparse.ArgumentParser) -> None:
    """The control plane's flags: ``--max-connections``, ``--join-max-connections``..."""
    for prefix, limits, what in (("", INTERNAL, "the internal listener (--port)"),
                                 ("join-", JOIN, "the join listener (--join-port)")):
        parser.add_argument(f"--{prefix}max-connections", type=int,
                            default=limits.max_connections, metavar="N",
                            help=f"open connections to {what} at most; beyond it new ones "
                                 f"are closed at accept, before TLS (default "
                                 f"{limits.max_connections})")
        parser.add_argument(f"--{prefix}max-connections-per-ip", type=int,
                            default=limits.max_per_ip, metavar="N",
                            help=f"open connections to {what} from one client IP at most "
                                 f"(default {limits.max_per_ip}; 0: no limit)")
        parser.add_argument(f"--{prefix}new-connections-per-ip", type=float,
                            default=limits.new_per_ip, metavar="PER_S",
                            help=f"new connections a second to {what} from one client IP, "
                                 f"with a burst of {BURST_S:g} s worth (default "
                                 f"{limits.new_per_ip:g}; 0: no limit)")
        parser.add_argument(f"--{prefix}handshake-timeout-s", type=float,
                            default=limits.handshake_timeout_s, metavar="S",
                            help=f"a TLS handshake on {what} not done within this is closed "
                                 f"(default {limits.handshake_timeout_s:g})")
    parser.add_argument("--connection-limits-exempt", default=",".join(DEFAULT_EXEMPT),
                        metavar="CIDR,...", help="client networks the per-IP limits of both "
                        "listeners never apply to (default: loopback, "
                        + ",".join(DEFAULT_EXEMPT) + "; 'none': no exemption)")


def listener_limits(args: argparse.Namespace,
                    exempt: tuple[str, ...]) -> tuple[ListenerLimits, ListenerLimits]:
    """(internal, join) from parsed flags; ValueError names a bad value."""
    return tuple(  # type: ignore[return-value]
        ListenerLimits(max_connections=getattr(args, f"{p}max_connections"),
                       max_per_ip=getattr(args, f"{p}max_connections_per_ip"),
                       new_per_ip=getattr(args, f"{p}new_connections_per_ip"),
                       handshake_timeout_s=getattr(args, f"{p}handshake_timeout_s"),
                       exempt=exempt)
        for p in ("", "join_"))
