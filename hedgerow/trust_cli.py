"""``hedgerow token create|list|revoke`` and ``hedgerow identity revoke``:
the operator's side of join tokens, through the control plane's admin API
(with the admin credential, as ``hedgerow policy`` uses it).

``token create`` prints the token alone on stdout (so ``> worker.token``
makes the file a worker reads with ``--join-token-file``) and, on stderr,
the CA pin and the command a new host runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hedgerow.policy_cli import (EXIT_OK, _add_admin_options, _call, _refused,
                                 _reporting_unreachable)

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``24h``, ``7d`` or plain seconds."""
    text = text.strip().lower()
    unit = DURATION_UNITS.get(text[-1:]) if text else None
    number = text[:-1] if unit else text
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 24h, 7d)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def add_trust_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    token = commands.add_parser("token", help="join tokens: create, list, revoke")
    actions = token.add_subparsers(dest="token_command", required=True)
    create = actions.add_parser("create", help="a token a new worker or gateway joins with")
    create.add_argument("--role", choices=("worker", "gateway"), required=True,
                        help="the role it may join as")
    create.add_argument("--ttl", type=parse_duration, default=24 * 3600.0,
                        help="how long it can be used to join (default 24h)")
    create.add_argument("--name", help="the only name it may join as (default: any)")
    create.add_argument("--description", default="",
                        help="a note shown by `hedgerow token list`")
    listing = actions.add_parser("list", help="every token (no secrets), holders, revocations")
    revoke = actions.add_parser("revoke", help="revoke a token and every identity it bought")
    revoke.add_argument("token_id", help="its id, from `hedgerow token list`")
    identity = commands.add_parser("identity", help="revoke a worker's or gateway's identity")
    id_actions = identity.add_subparsers(dest="identity_command", required=True)
    id_revoke = id_actions.add_parser("revoke", help="e.g. worker/cpu-1: its certificates stop "
                                      "working at once; a worker leaves the registry")
    id_revoke.add_argument("identity", help="ROLE/NAME, e.g. worker/cpu-1")
    for parser, run in ((create, run_create), (listing, run_list), (revoke, run_revoke),
                        (id_revoke, run_identity_revoke)):
        _add_admin_options(parser)
        parser.set_defaults(run=_reporting_unreachable(run))


def run_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"role": args.role, "ttl_s": args.ttl,
                            "description": args.description}
    if args.name:
        body["name"] = args.name
    response = _call(args, "POST", "/v1/tokens", json=body)
    if response.status_code != 201:
        return _refused(response)
    created = response.json()
    print(created["token"])
    pin = _ca_pin(args)
    flag = "--worker-id" if args.role == "worker" else "--gateway-id"
    print(f"join token {created['token_id']} for role {args.role}, valid until "
          f"{_when(created['expires_at'])}\n"
          f"  on the new host: hedgerow {args.role} --control-plane {args.control_plane} "
          f"{flag} NAME --join-token-file FILE --ca-pin {pin}", file=sys.stderr)
    return EXIT_OK


def run_list(args: argparse.Namespace) -> int:
    response = _call(args, "GET", "/v1/tokens")
    if response.status_code != 200:
        return _refused(response)
    body = response.json()
    for token in body["tokens"]:
        state = ("revoked" if token["revoked_at"] else
                 f"until {_when(token['expires_at'])}")
        only = f" as {token['name']}" if token["name"] else ""
        print(f"{token['token_id']}  {token['role']:<8}{only}  {state}  {token['description']}")
    for identity, holder in body["holders"].items():
        print(f"  {identity:<40} joined with {holder['token_id']}")
    for identity, when in body["revoked"].items():
        print(f"  {identity:<40} REVOKED at {_when(when)}")
    return EXIT_OK


def run_revoke(args: argparse.Namespace) -> int:
    response = _call(args, "DELETE", f"/v1/tokens/{args.token_id}")
    if response.status_code != 200:
        return _refused(response)
    identities = response.json()["identities"]
    print(f"revoked token {args.token_id}"
          + (f" and {', '.join(identities)}" if identities else ""))
    return EXIT_OK


def run_identity_revoke(args: argparse.Namespace) -> int:
    response = _call(args, "POST", "/v1/identities/revoke", json={"identity": args.identity})
    if response.status_code != 200:
        return _refused(response)
    print(f"revoked {response.json()['identity']}")
    return EXIT_OK


def _ca_pin(args: argparse.Namespace) -> str:
    from hedgerow.trust.ca import fingerprint
    from hedgerow.trust.credentials import Credentials, CredentialsError

    try:
        from cryptography import x509

        ca = x509.load_pem_x509_certificate(Credentials(args.admin_identity).ca_path.read_bytes())
        return fingerprint(ca)
    except (OSError, ValueError, CredentialsError):
        return "sha256:<the cluster CA's fingerprint>"


def _when(epoch: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
