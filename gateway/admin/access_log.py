"""One JSON line per completion request, on the ``hedgerow.access`` logger.

Written when the request ends (its stream finished, or it was refused), from
what ``RequestMetrics`` saw. Never the prompt, the answer or the API key: ids,
names, numbers. Fields:

``ts`` (UTC, ISO 8601), ``level`` (info), ``logger`` (hedgerow.access),
``message`` (access) -- the fields every ``--log-format json`` line has, so
one parser reads both -- then ``request_id``, ``method``, ``path`` (no query),
``tenant`` (empty: refused before it was known), ``model`` (canonical; empty:
refused before it was known), ``status`` (499: the client left first),
``error_code`` (empty on success; a stream that failed after its 200 has
one), ``prompt_tokens``, ``completion_tokens`` (the answer's usage),
``cached_tokens`` (their sum when no worker computed them for this request),
``cache`` (exact, semantic, joined; empty: none), ``ttft_ms`` (streaming:
arrival to the first token written; else null), ``duration_ms``, ``worker``,
``hedged``, ``protocol`` (HTTP/1.1, HTTP/2, HTTP/3), ``client`` (the peer's
address).

``hedgerow gateway --access-log`` picks where lines go: ``stderr`` (the
default), ``off``, or a file path (appended to, reopened when logrotate moves
it). The lines are bare JSON, whatever ``--log-format`` says, and do not reach
the root logger, so a program embedding the gateway routes them by the
logger's name.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from gateway.admin.metrics import RequestMetrics

LOGGER = "hedgerow.access"
OFF, STDERR = "off", "stderr"
PROTOCOLS = {"1.0": "HTTP/1.0", "1.1": "HTTP/1.1", "2": "HTTP/2", "3": "HTTP/3"}


class AccessLog:
    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(LOGGER)

    def write(self, observed: RequestMetrics, scope: dict[str, Any]) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        self.logger.info(orjson.dumps(access_record(observed, scope)).decode())


def access_record(observed: RequestMetrics, scope: dict[str, Any]) -> dict[str, Any]:
    """The line's fields (sans-IO: what the request saw, and the ASGI scope)."""
    usage = observed.usage
    prompt = usage.prompt_tokens if usage is not None else 0
    completion = usage.completion_tokens if usage is not None else 0
    client = scope.get("client")
    return {
        "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace(
            "+00:00", "Z"),
        "level": "info",
        "logger": LOGGER,
        "message": "access",
        "request_id": scope.get("hedgerow.request_id", ""),
        "method": scope.get("method", ""),
        "path": scope.get("path", ""),
        "tenant": observed.tenant,
        "model": observed.model,
        "status": observed.status,
        "error_code": observed.error_code,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": prompt + completion if usage is not None and usage.cached else 0,
        "cache": observed.cache,
        "ttft_ms": _ms(observed.ttft_s),
        "duration_ms": _ms(observed.duration_s),
        "worker": observed.worker,
        "hedged": observed.hedged,
        "protocol": PROTOCOLS.get(str(scope.get("http_version", "")), ""),
        "client": str(client[0]) if client else "",
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def configure_access_log(target: str) -> None:
    """Send ``hedgerow.access`` lines to ``target``: stderr, off, or a file path."""
    logger = logging.getLogger(LOGGER)
    for old in list(logger.handlers):
        logger.removeHandler(old)
        old.close()
    logger.propagate = False  # its own stream, not the process's log
    if target == OFF:
        logger.setLevel(logging.CRITICAL + 1)
        return
    handler: logging.Handler
    if target == STDERR:
        handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.handlers.WatchedFileHandler(Path(target))
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
