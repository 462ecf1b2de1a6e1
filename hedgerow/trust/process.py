"""One process's internal TLS, as its command line asks: the flags every
worker and gateway shares, and what they build (``InternalTls``).

``--insecure-internal`` turns all of it off (plain HTTP, nothing verified);
it is never the default and it logs loudly.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from hedgerow.trust.credentials import TlsContexts
from hedgerow.trust.identity import Identity, Role
from hedgerow.trust.join import CertificateRenewer, JoinOptions, ensure_identity

log = logging.getLogger("hedgerow.trust")

TOKEN_ENV = "HEDGEROW_JOIN_TOKEN"


@dataclass(frozen=True)
class InternalTls:
    """``contexts`` None: --insecure-internal."""

    contexts: TlsContexts | None
    control_plane: str

    @property
    def enabled(self) -> bool:
        return self.contexts is not None

    @property
    def scheme(self) -> str:
        return "https" if self.contexts is not None else "http"

    def server(self) -> ssl.SSLContext | None:
        return self.contexts.server() if self.contexts is not None else None

    def client(self, *, check_hostname: bool = True) -> ssl.SSLContext | bool:
        """For httpx's ``verify`` (True: plain HTTP needs nothing)."""
        if self.contexts is None:
            return True
        return self.contexts.client(check_hostname=check_hostname)

    def renewer(self) -> CertificateRenewer | None:
        if self.contexts is None:
            return None
        return CertificateRenewer(self.contexts, self.control_plane)

    @property
    def identity(self) -> Identity | None:
        return self.contexts.credentials.identity() if self.contexts is not None else None


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
