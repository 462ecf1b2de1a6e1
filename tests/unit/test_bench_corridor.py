"""The corridor micro-benchmark runs the real request path to completion."""

from __future__ import annotations

import pytest

from bench.corridor import measure


@pytest.mark.anyio
async def test_every_measured_request_completes_and_is_counted() -> None:
    result = await measure(30, 3)  # a request that did not complete raises
    assert (result["shape"], result["streams"], result["requests"]) == ("object", 3, 30)
    assert result["cpu_ms_per_request"] > 0 and result["requests_per_s"] > 0


@pytest.mark.anyio
async def test_the_app_mode_drives_whole_requests_and_counts_cpu_per_token() -> None:
    result = await measure(12, 2, tokens=40, app=True)  # a non-200 or empty answer raises
    assert (result["through"], result["requests"], result["tokens"]) == ("app", 12, 40)
    assert result["cpu_us_per_token"] > 0
