"""The overhead scenario, tiny: direct, Hedgerow and nginx measured side by side for real."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.overhead import OverheadPlan, measure_overhead
from bench.stack import Stack

pytestmark = pytest.mark.e2e

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_tiny_overhead_run_reports_sane_numbers_for_all_three(tmp_path: Path) -> None:
    out = measure_overhead(tmp_path, OverheadPlan(rounds=2, levels=((1, 4), (4, 12))))
    for target in ("direct", "hedgerow", "nginx"):
        assert out[target]["requests"] == 24 and out[target]["errors"] == 0
        assert 0 < out[target]["ttft_p50_ms"] <= out[target]["ttft_p99_ms"]
        assert set(out["by_streams"]["1"][target]) == set(out[target])
    for proxy in ("hedgerow", "nginx"):
        assert math.isfinite(out[f"{proxy}_added_p99_ms"])  # p99 of 24 samples is their max: noisy
        # A proxy's median is never far below direct's (24 samples on a shared machine).
        assert out[f"{proxy}_added_p50_ms"] > -10
        # CPU is counted in clock ticks (10 ms): nginx's ~0.5 ms x 24 requests
        # may round to zero ticks; Hedgerow's several ms a request never does.
        assert out[f"{proxy}_cpu_ms_per_request"] >= 0
    assert out["hedgerow_cpu_ms_per_request"] > 0
    assert 10 < out["hedgerow_rss_mb"] < 1000
    assert out["streams"] == 4 and out["client_http"] == "1.1"
    assert all((tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
               for name in ("ttft_cdf.png", "ttft_over_time.png"))


def test_bench_run_writes_png_plots(tmp_path: Path) -> None:
    (tmp_path / "stack").mkdir()
    stack = Stack(tmp_path / "stack")
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", "--backend", "sim", "--slots", "4",
                           "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "2")
        # Through the gateway: a worker's own URL takes only mutual TLS now, and
        # `bench run` drives any OpenAI-compatible URL a client can reach.
        stack.start_gateway()
        done = subprocess.run([sys.executable, "-m", "hedgerow.cli", "bench", "run",
                               stack.gateway_url, "--cacert", str(stack.ca_cert),
                               "--concurrency", "2", "--count", "6",
                               "--max-tokens", "4", "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=60)
    finally:
        stack.stop_all()
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout.splitlines()[-1])["overall"]["ok"] == 6
    for name in ("ttft_cdf.png", "ttft_over_time.png", "e2e_cdf.png", "e2e_over_time.png"):
        data = (tmp_path / "out" / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and b"IEND" in data[-12:], name
