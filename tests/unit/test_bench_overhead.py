"""The overhead scenario's pieces: its summary arithmetic, nginx config, CPU accounting, plots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import nginx
from bench.nginx import NginxConfig, NginxUnavailable, nginx_binary
from bench.overhead import Measured, OverheadPlan, summarize_long, summarize_overhead
from bench.plots import write_latency_plots
from bench.procstat import cpu_seconds, process_tree, rss_mb
from bench.records import LoadResult, RequestRecord
from bench.run import write_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def records(ttfts_ms: list[float]) -> list[RequestRecord]:
    return [RequestRecord(index=i, tag="chat", intended_s=i * 0.01, ttft_s=ms / 1000, e2e_s=ms / 500,
                          status=200) for i, ms in enumerate(ttfts_ms)]


def level(direct: list[float], hedgerow: list[float], nginx_ms: list[float],
          cpu_s: tuple[float, float], worker_cpu_s: float = 0.0) -> dict[str, Measured]:
    return {"direct": Measured(records(direct), cpu_s=worker_cpu_s),
            "hedgerow": Measured(records(hedgerow), cpu_s=cpu_s[0]),
            "nginx": Measured(records(nginx_ms), cpu_s=cpu_s[1])}


def test_added_latency_is_proxy_minus_direct_at_the_top_concurrency() -> None:
    direct = [10.0] * 99 + [20.0]
    measured = {1: level([5.0] * 10, [6.0] * 10, [5.5] * 10, (0.01, 0.001)),
                100: level(direct, [x + 3 for x in direct], [x + 1 for x in direct], (0.19, 0.019))}
    out = summarize_overhead(measured, OverheadPlan(rounds=1, levels=((1, 10), (100, 100))), "1.1")
    assert out["direct"]["ttft_p50_ms"] == 10.0 and out["direct"]["ttft_p99_ms"] == 10.0
    assert out["hedgerow_added_p50_ms"] == 3.0 and out["nginx_added_p99_ms"] == 1.0
    assert out["by_streams"]["1"]["hedgerow_added_p50_ms"] == 1.0
    # CPU over every measured request of both levels: 0.2 s / 110 requests.
    assert out["hedgerow_cpu_ms_per_request"] == pytest.approx(1.818, abs=0.001)
    assert out["nginx_cpu_ms_per_request"] == pytest.approx(0.182, abs=0.001)
    assert out["client_http"] == "1.1" and out["streams"] == 100


def test_long_answers_give_cpu_per_relayed_token_next_to_nginx() -> None:
    short = {1: level([5.0] * 10, [6.0] * 10, [5.5] * 10, (0.02, 0.01),
                      worker_cpu_s=0.015)}  # 2, 1 and (the worker, direct) 1.5 ms a request
    long = {1: level([5.0] * 10, [6.0] * 10, [5.5] * 10, (0.12, 0.03), worker_cpu_s=0.04)}
    plan = OverheadPlan(rounds=1, levels=((1, 10),), long_levels=((1, 10),), max_tokens=8,
                        long_tokens=258)
    row = summarize_long(short, long, plan)["side_by_side"]["1"]
    # (12 - 2) ms over 250 more tokens: 40 us a token; nginx (3 - 1) / 250: 8 us.
    assert row["hedgerow_cpu_us_per_token"] == 40.0 and row["nginx_cpu_us_per_token"] == 8.0
    assert row["cpu_per_token_vs_nginx"] == 5.0 and row["cpu_per_request_vs_nginx"] == 2.0
    assert row["hedgerow_added_p50_ms"] == 1.0 and row["nginx_added_p50_ms"] == 0.5
    # The worker serving the stream itself: 1.5 ms a request, (4 - 1.5) / 250 = 10 us a token.
    assert row["worker_cpu_ms_per_request"] == 1.5 and row["worker_cpu_us_per_token"] == 10.0
    assert row["worker_cpu_per_request_vs_nginx"] == 1.5
    assert row["worker_cpu_per_token_vs_nginx"] == 1.25
    assert "floor_cpu_ms_per_request" not in row  # not measured in this run
    assert plan.top_concurrency == 1


def test_failed_requests_are_counted_not_timed() -> None:
    failing = records([1.0, 2.0])
    failing[0].fail("transport")
    measured = {1: {"direct": Measured(records([1.0])), "hedgerow": Measured(failing),
                    "nginx": Measured(records([1.0]))}}
    out = summarize_overhead(measured, OverheadPlan(rounds=1, levels=((1, 2),)), "2")
    assert out["hedgerow"]["errors"] == 1 and out["hedgerow"]["ttft_p50_ms"] == 2.0


def test_nginx_config_streams_unbuffered_over_keepalive(tmp_path: Path) -> None:
    text = NginxConfig(tmp_path, 8443, "127.0.0.1:9000", tmp_path / "c.pem", tmp_path / "k.pem").render()
    for directive in ("daemon off;", "worker_processes 1;", "listen 127.0.0.1:8443 ssl http2;",
                      "proxy_buffering off;", "proxy_cache off;", "proxy_http_version 1.1;",
                      'proxy_set_header Connection "";', f"access_log {tmp_path / 'access.log'};",
                      "keepalive 256;",
                      "server 127.0.0.1:9000;"):
        assert directive in text


def test_missing_nginx_fails_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nginx, "NGINX_CANDIDATES", ("no-such-nginx-binary",))
    with pytest.raises(NginxUnavailable, match="apt-get install -y nginx"):
        nginx_binary()


def test_cpu_seconds_counts_the_child_processes_work() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        before = cpu_seconds(os.getpid())
        polls = 0
        while cpu_seconds(child.pid) < 0.25 and polls < 200:
            polls += 1
            subprocess.run(["sleep", "0.05"], check=True)
        assert child.pid in process_tree(os.getpid())
        assert cpu_seconds(os.getpid()) - before >= 0.2  # the child's burn counts for its parent
    finally:
        child.kill()
        child.wait()
    assert 1 < rss_mb(os.getpid()) < 4096


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"


def test_latency_plots_are_png_files(tmp_path: Path) -> None:
    paths = write_latency_plots(tmp_path, {"a": [(0.0, 0.01), (1.0, 0.02)], "empty": []},
                                title="t", metric="TTFT")
    assert [p.name for p in paths] == ["ttft_cdf.png", "ttft_over_time.png"]
    assert all(is_png(p) for p in paths)


def test_bench_run_plots_ttft_and_end_to_end(tmp_path: Path) -> None:
    result = LoadResult(records([5.0, 7.0, 9.0]), wall_s=1.0, load={"mode": "closed"})
    paths = write_plots(result, tmp_path)
    assert sorted(p.name for p in paths) == ["e2e_cdf.png", "e2e_over_time.png",
                                             "ttft_cdf.png", "ttft_over_time.png"]
    assert all(is_png(p) for p in paths)
