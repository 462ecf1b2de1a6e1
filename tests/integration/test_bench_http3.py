"""`hedgerow bench run --http 3`: the load generator over QUIC against a real gateway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.stack import Stack

pytestmark = pytest.mark.e2e


def test_bench_run_over_http3_streams_every_request(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", "--backend", "sim", "--slots", "4",
                           "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "2")
        stack.start_gateway()
        done = subprocess.run([sys.executable, "-m", "hedgerow.cli", "bench", "run",
                               stack.gateway_url, "--cacert", str(stack.ca_cert), "--http", "3",
                               "--concurrency", "3", "--count", "9", "--max-tokens", "6",
                               "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=60)
    finally:
        stack.stop_all()
    assert done.returncode == 0, done.stderr
    overall = orjson.loads(done.stdout.splitlines()[-1])["overall"]
    assert overall["ok"] == 9 and overall["errors"] == {}
    assert overall["itl_ms"]["count"] >= 9 * 4  # tokens arrived as separate events, not one burst
    records = orjson.loads((tmp_path / "out" / "records.json").read_bytes())
    assert {record["http_version"] for record in records} == {"HTTP/3"}
    assert {record["headers"]["x-hedgerow-worker"] for record in records} == {"sim-1"}
