"""Reading wrk's report: the percentiles the cache scenario records."""

from __future__ import annotations

import pytest

from bench.wrk import parse_wrk

REPORT = """Running 8s test @ https://127.0.0.1:40123/v1/chat/completions
  1 threads and 1 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     0.90ms  227.50us   4.97ms   88.27%
    Req/Sec     1.11k   162.42     1.47k    67.33%
  Latency Distribution
     50%  920.00us
     75%    1.00ms
     90%    1.07ms
     99%    2.01ms
  8876 requests in 8.00s, 5.31MB read
  Non-2xx or 3xx responses: 3
Requests/sec:   1109.38
Transfer/sec:    679.51KB
"""


def test_percentiles_come_out_in_milliseconds_whatever_wrk_printed() -> None:
    parsed = parse_wrk(REPORT)
    assert (parsed.p50_ms, parsed.p99_ms) == (0.92, 2.01)
    assert parsed.requests == 8876
    assert parsed.non_2xx == 3  # errors are reported, not hidden in the percentiles


def test_a_report_without_the_distribution_is_refused() -> None:
    with pytest.raises(RuntimeError, match="unexpected wrk output"):
        parse_wrk(REPORT.replace("     99%    2.01ms\n", ""))
