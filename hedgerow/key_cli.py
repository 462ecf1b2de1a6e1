"""``hedgerow key create|list|revoke``: virtual API keys, through the control
plane's admin API (``control_plane.key_api``) with the admin credential.

``key create`` prints the key alone on stdout, once (it is stored only as an
HMAC), so ``> client.key`` makes a file of it; what it is and the policy
version that carries it go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hedgerow.policy_cli import EXIT_OK, _add_admin_options, _call, _refused, _reporting_unreachable
from hedgerow.trust_cli import _when, parse_duration


def parse_budget(text: str) -> dict[str, Any]:
    """``tokens:100000/day``, ``cost:25/month``."""
    measure, _, rest = text.strip().partition(":")
    amount, _, period = rest.partition("/")
    if measure not in ("tokens", "cost") or period not in ("day", "month"):
        raise argparse.ArgumentTypeError(
            f"not a budget: {text!r} (e.g. tokens:100000/day or cost:25/month)")
    try:
        value: float | int = int(amount) if measure == "tokens" else float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {amount!r} in {text!r}") from None
    return {"period": period, measure: value}


def add_key_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    key = commands.add_parser("key", help="virtual API keys for clients: create, list, revoke")
    actions = key.add_subparsers(dest="key_command", required=True)
    create = actions.add_parser("create", help="a new API key for a tenant (printed once)")
    create.add_argument("--tenant", required=True, help="the policy's tenant it belongs to")
    create.add_argument("--name", default="", help="a label shown by `hedgerow key list`")
    create.add_argument("--ttl", type=parse_duration,
                        help="expire after this long (e.g. 30d, 12h; default: never)")
    create.add_argument("--model", action="append", dest="models", default=None,
                        help="a model it may use; repeat for several (default: every model)")
    create.add_argument("--requests-per-s", type=float,
                        help="its own requests/s limit, besides its tenant's")
    create.add_argument("--tokens-per-min", type=float,
                        help="its own tokens/min limit, besides its tenant's")
    create.add_argument("--budget", action="append", type=parse_budget, dest="budgets",
                        default=None, help="tokens:N/day|month or cost:X/day|month (in the "
                        "models' price currency); repeat for several")
    listing = actions.add_parser("list", help="every key, its tenant, expiry and budgets "
                                 "(never the key itself)")
    revoke = actions.add_parser("revoke", help="revoke a key: refused by every gateway "
                                "within about a second")
    revoke.add_argument("key_id", help="its id (key_…), from `hedgerow key list`")
    for parser, run in ((create, run_create), (listing, run_list), (revoke, run_revoke)):
        _add_admin_options(parser)
        parser.set_defaults(run=_reporting_unreachable(run))


def run_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"tenant": args.tenant, "name": args.name}
    if args.ttl is not None:
        body["ttl_s"] = args.ttl
    if args.models:
        body["models"] = args.models
    for option in ("requests_per_s", "tokens_per_min"):
        if getattr(args, option) is not None:
            body[option] = getattr(args, option)
    if args.budgets:
        body["budgets"] = args.budgets
    response = _call(args, "POST", "/v1/keys", json=body)
    if response.status_code != 201:
        return _refused(response)
    created = response.json()
    print(created["key"])
    expiry = (f"until {_when(created['expires_at'])}" if created.get("expires_at")
              else "no expiry")
    print(f"key {created['id']} for tenant {created['tenant']} ({expiry}), in policy "
          f"version {created['version']}; it is shown only this once", file=sys.stderr)
    return EXIT_OK


def run_list(args: argparse.Namespace) -> int:
    response = _call(args, "GET", "/v1/keys")
    if response.status_code != 200:
        return _refused(response)
    for key in response.json()["keys"]:
        state = ("EXPIRED" if key["expired"] else
                 f"until {_when(key['expires_at'])}" if key.get("expires_at") else "no expiry")
        models = ",".join(key.get("models") or ()) or "all models"
        budgets = " ".join(_budget_text(b) for b in key.get("budgets") or ())
        print(f"{key['id']}  {key['tenant']:<16} {key.get('name') or '-':<16} {state}  "
              f"{models}{'  ' + budgets if budgets else ''}")
    return EXIT_OK


def run_revoke(args: argparse.Namespace) -> int:
    response = _call(args, "DELETE", f"/v1/keys/{args.key_id}")
    if response.status_code != 200:
        return _refused(response)
    print(f"revoked key {args.key_id} (policy version {response.json()['version']})")
    return EXIT_OK


def _budget_text(budget: dict[str, Any]) -> str:
    measure = "tokens" if budget.get("tokens") is not None else "cost"
    return f"{measure}:{budget[measure]:g}/{budget['period']}"
