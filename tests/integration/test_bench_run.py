"""`hedgerow bench run` against a real gateway: numbers, files, and errors counted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("benchrun"))
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", "--backend", "sim", "--slots", "4",
                           "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "3")
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


def bench(stack: Stack, *args: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "hedgerow.cli", "bench", "run",
                           stack.gateway_url, "--cacert", str(stack.ca_cert), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(orjson.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("http", ["1.1", "2"])
def test_closed_loop_reports_percentiles_and_writes_files(stack: Stack, tmp_path: Path,
                                                          http: str) -> None:
    summary = bench(stack, "--concurrency", "3", "--count", "12", "--max-tokens", "8",
                    "--http", http, "--out", str(tmp_path))
    overall = summary["overall"]
    assert isinstance(overall, dict)
    assert overall["requests"] == 12 and overall["ok"] == 12
    assert overall["ttft_ms"]["p50"] > 0 and overall["itl_ms"]["count"] >= 12 * 6
    assert (tmp_path / "summary.md").read_text().count("|") > 10
    assert len(orjson.loads((tmp_path / "records.json").read_bytes())) == 12


def test_open_loop_counts_errors_by_kind(stack: Stack) -> None:
    summary = bench(stack, "--rate", "20", "--count", "10", "--model", "no-such-model")
    overall = summary["overall"]
    assert isinstance(overall, dict)
    assert overall["ok"] == 0 and overall["errors"] == {"http_status": 10}
    assert overall["status"] == {"404": 10}
