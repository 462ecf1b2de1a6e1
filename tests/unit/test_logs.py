"""Structured logs: one JSON object a line, carrying the request being served."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from collections.abc import Iterator

import anyio
import orjson
import pytest

from hedgerow.cli import build_parser
from hedgerow.logs import (
    build_handler,
    configure_logging,
    request_id_var,
    safe_request_id,
)


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = build_handler("json")
    handler.setStream(out)  # type: ignore[attr-defined]
    logger = logging.getLogger("hedgerow.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, out
    logger.removeHandler(handler)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


def test_json_line_has_the_fields_and_the_request_id(
        captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = captured
    logger.info("no request here")
    token = request_id_var.set("abc123")
    try:
        logger.warning("worker %s failed", "w1")
    finally:
        request_id_var.reset(token)
    outside, inside = lines(out)
    assert "request_id" not in outside
    assert inside["request_id"] == "abc123"
    assert inside["message"] == "worker w1 failed"
    assert inside["level"] == "warning"
    assert inside["logger"] == "hedgerow.test.logs"
    assert str(inside["ts"]).endswith("Z")


def test_exceptions_are_kept_inside_the_one_line(
        captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = captured
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("it broke")
    (entry,) = lines(out)
    assert "ValueError: boom" in str(entry["exc_info"])


@pytest.mark.anyio
async def test_tasks_started_by_a_request_log_its_id(
        captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = captured

    async def serve(request_id: str) -> None:
        request_id_var.set(request_id)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_log_later, logger, f"attempt for {request_id}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, "r1")
        tg.start_soon(serve, "r2")
    by_message = {entry["message"]: entry["request_id"] for entry in lines(out)}
    assert by_message == {"attempt for r1": "r1", "attempt for r2": "r2"}


async def _log_later(logger: logging.Logger, message: str) -> None:
    await anyio.sleep(0.01)
    logger.info(message)


def test_request_ids_from_outside_are_only_kept_when_they_look_like_ids() -> None:
    assert safe_request_id("0f3a9c2e4b5d") == "0f3a9c2e4b5d"
    assert safe_request_id(None) is None
    assert safe_request_id("") is None
    assert safe_request_id("x" * 65) is None
    assert safe_request_id('a"}\n{"level": "fake"') is None


def test_log_format_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["control-plane"]).log_format == "text"
    assert build_parser().parse_args(["--log-format", "json", "control-plane"]).log_format == "json"
    monkeypatch.setenv("HEDGEROW_LOG_FORMAT", "json")
    assert build_parser().parse_args(["control-plane"]).log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-format", "xml", "control-plane"])
    with pytest.raises(ValueError):
        configure_logging("info", "xml")  # type: ignore[arg-type]


def test_importing_faiss_writes_nothing_at_info() -> None:
    """faiss logs every CPU build it cannot load at info; after our logging setup
    the first screen of ``make run`` shows none of it."""
    code = ("from hedgerow.logs import configure_logging; configure_logging('info'); "
            "import faiss; import logging; logging.getLogger('hedgerow').info('ready')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "faiss.loader" not in done.stderr
    assert "ready" in done.stderr  # our own info lines still show
