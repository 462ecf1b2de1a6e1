"""The throughput scenario, tiny: cache hits through Hedgerow next to bare Hypercorn and Hypercorn with Hedgerow's transport, for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.throughput import ThroughputPlan, measure_throughput, parse_h2load

pytestmark = pytest.mark.e2e

H2LOAD_TAIL = """
finished in 1.09s, 916.81 req/s, 44.03KB/s
requests: 1000 total, 1000 started, 1000 done, 998 succeeded, 2 failed, 0 errored, 0 timeout
status codes: 998 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 47.98KB (49132) total, 13.75KB (14082) headers (space savings 80.27%), 16.60KB (17000) data
                     min         max         mean         sd        +/- sd
time for request:      607us     22.71ms      1.06ms      2.10ms    96.90%
"""


def test_h2load_summary_is_read() -> None:
    result = parse_h2load("Application protocol: h2\n" + H2LOAD_TAIL)
    assert (result.requests, result.succeeded, result.failed, result.status_2xx) == (1000, 998, 2, 998)
    assert result.seconds == pytest.approx(1.09) and result.protocol == "h2"
    assert parse_h2load(H2LOAD_TAIL.replace("1.09s", "850.5ms")).seconds == pytest.approx(0.8505)


def test_tiny_throughput_run_counts_only_exact_cache_hits(tmp_path: Path) -> None:
    plan = ThroughputPlan(rounds=2, requests=150, clients=2, streams=4)
    out = measure_throughput(tmp_path, plan)
    primed = out["primed"]
    assert (primed["json_first"], primed["json_again"], primed["stream_again"]) == (
        "miss", "exact", "exact")
    for target in ("bare_hypercorn", "hypercorn_transport", "hedgerow", "hedgerow_stream"):
        assert out[target]["succeeded"] == 300 and out[target]["failed"] == 0, out[target]
        assert out[target]["protocol"] == "h2"  # HTTP/2 over TLS (ALPN) to both servers
        assert len(out[target]["rps_by_round"]) == 2
        assert out[target]["cpu_ms_per_request"] > 0
    # The gateway's own counter: every measured request was answered from the cache.
    assert out["hedgerow"]["exact_hits"] == 300 and out["hedgerow_stream"]["exact_hits"] == 300
    assert out["hedgerow_rps"] > 0 and out["bare_hypercorn_rps"] > 0
    assert out["ratio"] == round(out["hedgerow_rps"] / out["bare_hypercorn_rps"], 3)
    assert out["ratio_vs_transport"] == round(
        out["hedgerow_rps"] / out["hypercorn_transport_rps"], 3)
    assert out["baseline"] == "bare_hypercorn" and "hypercorn_transport" in out["baselines"]
    assert 10 < out["hedgerow_rss_mb"] < 300  # no embedding model loaded
