"""The open-connection cap's counting (sans-IO) and its metric families."""

from __future__ import annotations

import pytest
from prometheus_client.exposition import generate_latest

from hedgerow import connection_cap
from hedgerow.connection_cap import FD_RESERVE, ConnectionCap, fit_file_limit
from gateway.admin.metrics import GatewayMetrics


def test_the_cap_counts_and_refuses_at_the_limit() -> None:
    cap = ConnectionCap(2)
    assert [cap.try_open() for _ in range(4)] == [True, True, False, False]
    assert cap.stats() == {"open": 2, "refused": 2, "limit": 2}
    cap.close()
    assert cap.try_open() and not cap.try_open()
    assert cap.refusals_to_log(now=100.0) == 3
    cap.try_open()
    assert cap.refusals_to_log(now=101.0) == 0  # at most one log line per LOG_EVERY_S
    assert cap.refusals_to_log(now=111.0) == 1
    with pytest.raises(ValueError):
        ConnectionCap(0)


def test_closing_more_than_were_opened_is_a_bug() -> None:
    cap = ConnectionCap(1)
    with pytest.raises(RuntimeError):
        cap.close()


def test_the_metrics_show_open_limit_and_refused() -> None:
    cap = ConnectionCap(1)
    for _ in range(3):
        cap.try_open()
    metrics = GatewayMetrics()
    metrics.watch_connections(cap.stats)
    text = generate_latest(metrics.registry).decode()
    assert "hedgerow_connections_open 1.0" in text
    assert "hedgerow_connections_limit 1.0" in text
    assert "hedgerow_connections_refused_total 2.0" in text
    assert "hedgerow_connections" not in generate_latest(GatewayMetrics().registry).decode()


def test_the_cap_is_lowered_to_what_the_open_file_limit_can_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"soft": 1024, "hard": 1500}

    def setrlimit(_: int, value: tuple[int, int]) -> None:
        limits["soft"] = value[0]

    monkeypatch.setattr(connection_cap.resource, "getrlimit",
                        lambda _: (limits["soft"], limits["hard"]))
    monkeypatch.setattr(connection_cap.resource, "setrlimit", setrlimit)
    assert fit_file_limit(1000) == 1000 and limits["soft"] == 1000 + FD_RESERVE  # raised
    assert fit_file_limit(4096) == 1500 - FD_RESERVE and limits["soft"] == 1500  # hard limit
