"""Logging set-up shared by every process kind: text for people, JSON for machines.

``--log-format json`` (or ``HEDGEROW_LOG_FORMAT=json``) writes one JSON object
per line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
``request_id`` while a request is being served, and ``exc_info`` with a
traceback. The request id lives in a ``ContextVar`` that the gateway sets for
each request (and the worker from the ``x-request-id`` it receives), so every
task the request starts logs it too. Log messages carry ids and reasons, never
prompts, completions or keys.
"""

from __future__ import annotations

import logging
import re
import sys
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Literal

import orjson

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_id_var: ContextVar[str | None] = ContextVar("hedgerow_request_id", default=None)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def safe_request_id(value: str | None) -> str | None:
    """``value`` if it looks like a request id (it may come from anyone), else None."""
    if value is None or _REQUEST_ID.fullmatch(value) is None:
        return None
    return value


class RequestIdFilter(logging.Filter):
    """Stamps each record with the request id of the context that logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, tz=timezone.utc)
        entry: dict[str, object] = {
            "ts": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def build_handler(log_format: LogFormat = "text") -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    return handler


def configure_logging(level: str = "info", log_format: LogFormat = "text") -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    logging.basicConfig(level=level.upper(), handlers=[build_handler(log_format)])
    # hypercorn's per-connection chatter is noise at info level.
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # faiss tries its CPU builds in turn at import and logs each one this CPU
    # lacks (a traceback line apiece) at info: a newcomer's first screen of
    # `make run` read like errors.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
