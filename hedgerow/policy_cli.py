"""``hedgerow policy``: validate a file offline; apply, show, list and roll back
versions through the control plane's admin API.

Each problem with a policy is printed as ``file:line:column: path: message``.

Exit status: 0 done; 1 refused (an invalid policy, which changed nothing, or
an unknown version); 2 wrong usage; 3 the control plane could not be reached
or answered unexpectedly.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from hedgerow.cli import DEFAULT_CONTROL_PLANE

EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE = 0, 1, 3
REQUEST_TIMEOUT_S = 10.0
ADMIN_URL_ENV = "HEDGEROW_ADMIN_URL"
ADMIN_IDENTITY_ENV = "HEDGEROW_ADMIN_IDENTITY"
DEFAULT_ADMIN_IDENTITY = ".hedgerow/control-plane/admin"

Command = Callable[[argparse.Namespace], int]


def add_policy_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    policy = commands.add_parser(
        "policy", help="validate, apply, show, list and roll back operator policy",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = policy.add_subparsers(dest="policy_command", required=True)
    validate = actions.add_parser("validate", help="check a policy file offline")
    validate.add_argument("file", type=Path, help="a policy YAML file")
    validate.set_defaults(run=run_validate)
    apply = actions.add_parser("apply", help="validate and activate a policy file")
    apply.add_argument("file", type=Path, help="a policy YAML file")
    show = actions.add_parser("show", help="print the active policy, or VERSION")
    show.add_argument("version", nargs="?", type=int,
                      help="a retained version (default: the active one)")
    history = actions.add_parser("history", help="list the retained versions")
    rollback = actions.add_parser("rollback", help="activate an earlier version's content")
    rollback.add_argument("version", type=int, help="the version to activate again")
    for action, run in ((apply, run_apply), (show, run_show), (history, run_history),
                        (rollback, run_rollback)):
        _add_admin_options(action)
        action.set_defaults(run=_reporting_unreachable(run))


def add_status_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    status = commands.add_parser(
        "status", help="every worker and gateway, and the policy version each gateway runs")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    _add_admin_options(status)
    status.set_defaults(run=_reporting_unreachable(run_status))


def run_status(args: argparse.Namespace) -> int:
    response = _call(args, "GET", "/v1/status")
    if response.status_code != 200:
        return _refused(response)
    body = response.json()
    if args.json:
        print(response.text)
        return EXIT_OK
    policy = body.get("policy")
    if policy:
        print(f"policy: version {policy['version']} (checksum {policy['checksum'][:12]})")
    print(f"gateways: {len(body.get('gateways', []))}")
    for gw in body.get("gateways", []):
        last = gw["last_answer"]
        state = "ok" if last["accepted"] else f"REJECTED v{last['version']}: {last['error']}"
        print(f"  {gw['gateway_id']:<32} runs v{gw['running_version']}  {state}  "
              f"({gw['seconds_since_answer']}s ago)")
    print(f"workers: {len(body['workers'])}")
    for w in body["workers"]:
        labels = ",".join(f"{k}={v}" for k, v in w["labels"].items())
        print(f"  {w['worker_id']:<32} {w['kind']:<4}{_device(w)} slots {w['slots']} active {w['active']}"
              f"{'  draining' if w['draining'] else ''}{'  external' if w.get('external') else ''}"
              f"  {' '.join(w['models'])}"
              f"{'  ' + labels if labels else ''}")
    return EXIT_OK


def _device(worker: dict[str, Any]) -> str:
    """`` (NVIDIA H200, 140 GiB)`` for a GPU worker, nothing for others."""
    if not worker.get("device"):
        return ""
    memory = worker.get("device_memory_bytes")
    return f" ({worker['device']}{f', {memory / 2**30:.0f} GiB' if memory else ''})"


def run_validate(args: argparse.Namespace) -> int:
    from policies.loader import decode_policy_bytes, parse_policy_document, policy_checksum
    from policies.schema import PolicyError

    source = str(args.file)
    try:
        policy = parse_policy_document(decode_policy_bytes(args.file.read_bytes(), source), source)
    except OSError as error:
        return _fail(f"cannot read {source}: {error.strerror or error}")
    except PolicyError as error:
        print(error)
        return EXIT_REFUSED
    print(f"{source}: valid; checksum {policy_checksum(policy)}")
    return EXIT_OK


def run_apply(args: argparse.Namespace) -> int:
    source = str(args.file)
    try:
        text = args.file.read_bytes()
    except OSError as error:
        return _fail(f"cannot read {source}: {error.strerror or error}")
    response = _call(args, "POST", "/v1/policy", content=text, params={"source": source})
    if response.status_code not in (200, 201):
        return _refused(response, "not applied; the active policy is unchanged")
    reply = response.json()
    if reply["changed"]:
        print(f"applied {source} as policy v{reply['version']}; checksum {reply['checksum']}")
    else:
        print(f"unchanged: policy v{reply['version']} already has this content; "
              f"checksum {reply['checksum']}")
    return EXIT_OK


def run_show(args: argparse.Namespace) -> int:
    path = "/v1/policy" if args.version is None else f"/v1/policy/{args.version}"
    response = _call(args, "GET", path)
    if response.status_code != 200:
        return _refused(response)
    reply = response.json()
    print(f"# policy v{reply['version']}, applied {_when(reply['applied_at'])} from "
          f"{reply['source']}; checksum {reply['checksum']}", file=sys.stderr)
    sys.stdout.write(reply["text"] if reply["text"].endswith("\n") else reply["text"] + "\n")
    return EXIT_OK


def run_history(args: argparse.Namespace) -> int:
    response = _call(args, "GET", "/v1/policy/history")
    if response.status_code != 200:
        return _refused(response)
    reply = response.json()
    print(f"  {'VERSION':>7}  {'APPLIED (UTC)':<19}  {'CHECKSUM':<12}  SOURCE")
    for entry in reply["versions"]:
        marker = "*" if entry["version"] == reply["current"] else " "
        print(f"{marker} {entry['version']:>7}  {_when(entry['applied_at']):<19}  "
              f"{entry['checksum'][:12]}  {entry['source']}")
    return EXIT_OK


def run_rollback(args: argparse.Namespace) -> int:
    response = _call(args, "POST", f"/v1/policy/rollback/{args.version}")
    if response.status_code not in (200, 201):
        return _refused(response, "nothing rolled back; the active policy is unchanged")
    reply = response.json()
    if reply["changed"]:
        print(f"rolled back: policy v{reply['version']} has the content of v{args.version}; "
              f"checksum {reply['checksum']}")
    else:
        print(f"unchanged: the active policy v{reply['version']} already has the content "
              f"of v{args.version}")
    return EXIT_OK


def check_startup_policy(policy_file: Path, policy_dir: Path | None) -> str | None:
    """Why a control plane cannot start with these options, or None."""
    from control_plane.policy_service import load_initial_store
    from policies.schema import PolicyError

    if policy_dir is not None and not policy_dir.is_dir():
        return f"--policy-dir {policy_dir} is not a directory"
    try:
        load_initial_store(policy_file)
    except OSError as error:
        return f"cannot read the policy {policy_file}: {error.strerror or error}"
    except PolicyError as error:
        return f"the policy {policy_file} is invalid; not starting:\n{error}"
    return None


def _add_admin_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--control-plane", default=os.environ.get(
        "HEDGEROW_CONTROL_PLANE", DEFAULT_CONTROL_PLANE),
        help="control plane base URL, where its admin API is unless --admin-url says "
             "otherwise (default $HEDGEROW_CONTROL_PLANE or %(default)s)")
    parser.add_argument("--admin-url", default=os.environ.get(ADMIN_URL_ENV) or None,
                        help="the admin API's base URL, for a control plane started with "
                             f"--admin-port (default ${ADMIN_URL_ENV}; none: --control-plane)")
    parser.add_argument("--admin-token-file", type=Path,
                        help="file holding the admin token (default $HEDGEROW_ADMIN_TOKEN)")
    parser.add_argument("--admin-identity", type=Path, default=Path(os.environ.get(
        ADMIN_IDENTITY_ENV, DEFAULT_ADMIN_IDENTITY)),
        help="directory with the admin credential (key.pem, cert.pem, ca.pem) the control "
             f"plane wrote (default ${ADMIN_IDENTITY_ENV} or %(default)s)")


class _Unreachable(Exception):
    pass


def _admin_headers(args: argparse.Namespace) -> dict[str, str]:
    from hedgerow.admin_token import read_admin_token

    try:
        token = read_admin_token(args.admin_token_file)
    except (OSError, ValueError) as error:
        raise _BadToken(f"cannot use the admin token: {error}") from None
    return {} if token is None else {"authorization": f"Bearer {token}"}


class _BadToken(Exception):
    pass


def admin_verify(args: argparse.Namespace, base: str) -> ssl.SSLContext | bool:
    """The admin credential's TLS context for an https:// control plane."""
    if not base.startswith("https:"):
        return True
    from hedgerow.trust.credentials import Credentials, CredentialsError, TlsContexts

    try:
        return TlsContexts(Credentials(args.admin_identity)).client()
    except CredentialsError as error:
        raise _BadToken(f"no admin credential: {error} (the control plane writes one into "
                        "its --state-dir/admin; point --admin-identity or "
                        f"${ADMIN_IDENTITY_ENV} at it)") from None


def _call(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> httpx.Response:
    base = args.admin_url or args.control_plane
    headers = _admin_headers(args)
    verify = admin_verify(args, base)
    try:
        return httpx.request(method, base.rstrip("/") + path, timeout=REQUEST_TIMEOUT_S,
                             headers=headers, verify=verify, **kwargs)
    except httpx.HTTPError as error:
        raise _Unreachable(f"cannot reach the control plane at {base}: "
                           f"{error or type(error).__name__}") from None


def _reporting_unreachable(run: Command) -> Command:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except _Unreachable as error:
            return _fail(str(error), EXIT_UNREACHABLE)
        except _BadToken as error:
            return _fail(str(error), 2)
    return wrapped


def _refused(response: httpx.Response, consequence: str = "") -> int:
    """Print why the control plane said no; the exit status says who is at fault."""
    try:
        body = response.json()
        message = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return _fail(f"unexpected answer from the control plane: HTTP {response.status_code}",
                     EXIT_UNREACHABLE)
    issues = body.get("issues")
    if issues:
        for issue in issues:
            print(f"{issue['source']}:{issue['line']}:{issue['column']}: "
                  f"{issue['path']}: {issue['message']}")
        if body.get("omitted"):
            print(f"(and {body['omitted']} more problems)")
    else:
        print(f"hedgerow: {message}", file=sys.stderr)
    if response.status_code == 401:
        print("hedgerow: set $HEDGEROW_ADMIN_TOKEN or pass --admin-token-file", file=sys.stderr)
    if response.status_code == 404 and body["error"].get("code") == "not_found":
        print(f"hedgerow: a control plane started with --admin-port serves its admin API "
              f"there only: pass --admin-url or set ${ADMIN_URL_ENV}", file=sys.stderr)
    if consequence:
        print(f"hedgerow: {consequence}", file=sys.stderr)
    return EXIT_REFUSED if 400 <= response.status_code < 500 else EXIT_UNREACHABLE


def _fail(message: str, status: int = EXIT_REFUSED) -> int:
    print(f"hedgerow: {message}", file=sys.stderr)
    return status


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S")
