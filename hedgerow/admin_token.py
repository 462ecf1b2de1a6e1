"""The operator tokens, shared by the control plane's and the gateway's admin listeners.

An admin listener (the control plane's ``--admin-port``, the gateway's
``--admin-port``) is guarded by a bearer token kept apart from tenant API
keys: read from a file or ``$HEDGEROW_ADMIN_TOKEN`` (``read_admin_token``),
compared in constant time (``presents_token``) and never logged. Without a
token the API is open, so its listener binds to loopback only
(``admin_bind_host``). Prometheus holds a read-only metrics token
(``read_metrics_token``), never the admin token.

Here, not in ``control_plane``, so that the gateway and the CLI use them
without importing the control plane (``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from hedgerow.asgi import Request

log = logging.getLogger("hedgerow.admin")

TOKEN_ENV = "HEDGEROW_ADMIN_TOKEN"
METRICS_TOKEN_ENV = "HEDGEROW_METRICS_TOKEN"
LOOPBACK = "127.0.0.1"
MAX_TOKEN_CHARS = 4096


def read_admin_token(token_file: Path | None) -> str | None:
    """The token from ``token_file`` (whitespace stripped), else ``$HEDGEROW_ADMIN_TOKEN``,
    else None. Raises ``ValueError`` for an empty or oversized token."""
    return _read_token(token_file, TOKEN_ENV, "admin")


def read_metrics_token(token_file: Path | None) -> str | None:
    """The read-only ``/metrics`` token: ``token_file``, else ``$HEDGEROW_METRICS_TOKEN``."""
    return _read_token(token_file, METRICS_TOKEN_ENV, "metrics")


def _read_token(token_file: Path | None, env: str, what: str) -> str | None:
    raw = token_file.read_text() if token_file is not None else os.environ.get(env)
    if raw is None:
        return None
    token = raw.strip()
    where = str(token_file) if token_file is not None else f"${env}"
    if not token or len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"the {what} token in {where} must be 1-{MAX_TOKEN_CHARS} "
                         "characters without spaces")
    return token


def presents_token(request: Request, tokens: Sequence[bytes]) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <one of tokens>``."""
    scheme, _, presented = (request.header("authorization") or "").partition(" ")
    given = presented.strip().encode()
    # compare_digest on bytes: constant time whatever the presented value; every
    # token is compared (a list, not any() over a generator), so the time taken
    # does not tell which one matched.
    matches = [hmac.compare_digest(given, token) for token in tokens]
    return scheme.lower() == "bearer" and any(matches)


def admin_bind_host(host: str, token: str | None) -> str:
    """Where to listen: as asked with a token; loopback only without one."""
    if token is not None:
        return host
    if _is_loopback(host):
        log.warning("no admin token configured (--admin-token-file or $%s): the admin API "
                    "is unauthenticated; listening on loopback only", TOKEN_ENV)
        return host
    log.warning("no admin token configured (--admin-token-file or $%s): the admin API would "
                "be unauthenticated, so listening on %s instead of %s", TOKEN_ENV, LOOPBACK, host)
    return LOOPBACK


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
