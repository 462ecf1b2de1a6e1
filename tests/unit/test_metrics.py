"""Metrics as an operator reads them: the Prometheus text each process serves.

Every test renders through prometheus-client's own exposition and parses the
text back with its parser, so what is asserted is what a scraper would see.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from control_plane.metrics import ControlPlaneMetrics
from gateway.admin.metrics import CLIENT_CLOSED, GatewayMetrics, status_of
from hedgerow.errors import NoHealthyWorker, RateLimited
from hedgerow.latest import LatestValue
from hedgerow.metrics import Histogram, render
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration
from workers.backend import BackendLoad, Finished, TokenChunk
from workers.metrics import GenerationTiming, WorkerMetrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: bytes) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the series whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def family_names(text: bytes) -> list[str]:
    return [f.name for f in text_string_to_metric_families(text.decode())]


def record(worker_id: str, slots: int) -> WorkerRecord:
    return WorkerRecord(
        registration=WorkerRegistration(worker_id=worker_id, url="http://127.0.0.1:1",
                                        kind="sim", models=("m",), slots=slots),
        load=WorkerLoad(), lease_expires_in_s=3.0)


# -- the histogram ---------------------------------------------------------------


def test_histogram_buckets_are_less_or_equal_and_cumulative() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("t_seconds", "test", ("model",), (0.1, 1.0), registry)
    series = histogram.labels("m")
    for seconds in (0.05, 0.1, 0.5, 1.0, 7.0):
        series.observe(seconds)
    samples = parse(render(registry))
    assert value(samples, "t_seconds_bucket", model="m", le="0.1") == 2
    assert value(samples, "t_seconds_bucket", model="m", le="1.0") == 4
    assert value(samples, "t_seconds_bucket", model="m", le="+Inf") == 5
    assert value(samples, "t_seconds_count", model="m") == 5
    assert value(samples, "t_seconds_sum", model="m") == pytest.approx(8.65)


@given(st.lists(st.floats(min_value=0, max_value=1000), max_size=50))
def test_histogram_count_and_sum_match_what_was_observed(values: list[float]) -> None:
    registry = CollectorRegistry()
    series = Histogram("h_seconds", "h", (), (0.001, 0.1, 10.0), registry).labels()
    for v in values:
        series.observe(v)
    samples = parse(render(registry))
    assert value(samples, "h_seconds_count") == len(values)
    assert value(samples, "h_seconds_sum") == pytest.approx(sum(values))
    assert value(samples, "h_seconds_bucket", le="0.1") == sum(1 for v in values if v <= 0.1)


def test_histogram_series_are_capped_into_other() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("c_seconds", "c", ("model",), (1.0,), registry, max_series=2)
    for model in ("a", "b", "c", "d"):
        histogram.labels(model).observe(0.5)
    samples = parse(render(registry))
    assert value(samples, "c_seconds_count", model="a") == 1
    assert value(samples, "c_seconds_count", model="_other") == 2
    assert value(samples, "c_seconds_count") == 4


def test_histogram_refuses_a_duplicate_name_and_bad_buckets() -> None:
    registry = CollectorRegistry()
    Histogram("d_seconds", "d", (), (1.0,), registry)
    with pytest.raises(ValueError):
        Histogram("d_seconds", "again", (), (1.0,), registry)
    with pytest.raises(ValueError):
        Histogram("e_seconds", "e", (), (1.0, 0.5), CollectorRegistry())
    with pytest.raises(ValueError):
        Histogram("f_seconds", "f", ("model",), (1.0,), CollectorRegistry()).labels()


# -- the gateway -------------------------------------------------------------------

STATS = {
    "counters": {"shed_concurrency": 2, "shed_deadline": 1, "hedges_started": 3,
                 "hedge_budget_exhausted": 1, "retries": 4, "breaker_to_open": 1},
    "breakers": {"w1": "open", "w2": "closed"},
    "queued": {"m": 5},
    "inflight": {"w2": 1},
    "hedge_budget": {"level": 2.5},
}


def streamed_request(metrics: GatewayMetrics) -> None:
    """A stream that arrived at 10.0, queued 0.1 s, and relayed two tokens."""
    request = metrics.request(10.0)
    request.labelled("m", "interactive")
    request.dispatched(submitted=10.001, assigned=10.101, upstream=10.102)
    request.responded(200)
    request.relayed(10.2, 10.2001, token=False)  # the role chunk
    request.relayed(10.3, 10.3005, token=True)
    request.relayed(10.31, 10.3102, token=True)
    request.relayed(10.32, 10.3201, token=False)  # [DONE]
    request.finished(10.4)


def test_a_streamed_request_feeds_every_latency_histogram() -> None:
    metrics = GatewayMetrics()
    streamed_request(metrics)
    s = parse(metrics.render(STATS, RegistrySnapshot(version=0)))
    by = {"model": "m", "class": "interactive"}
    assert value(s, "hedgerow_ttft_seconds_sum", **by) == pytest.approx(0.3005)
    assert value(s, "hedgerow_itl_seconds_count", **by) == 1
    assert value(s, "hedgerow_itl_seconds_sum", **by) == pytest.approx(0.0097)
    assert value(s, "hedgerow_queue_wait_seconds_sum", **by) == pytest.approx(0.1)
    assert value(s, "hedgerow_request_duration_seconds_sum", **by) == pytest.approx(0.4)
    # Before the upstream request: 1 ms before the queue + 1 ms after the slot.
    assert value(s, "hedgerow_gateway_overhead_seconds_sum", phase="request") == pytest.approx(0.002)
    assert value(s, "hedgerow_gateway_overhead_seconds_sum", phase="first_token") == pytest.approx(0.0005)
    assert value(s, "hedgerow_gateway_overhead_seconds_sum", phase="chunk") == pytest.approx(0.0002)
    assert value(s, "hedgerow_requests_total", status="200", **by) == 1


def test_refusals_and_errors_are_counted_by_status_without_latencies() -> None:
    metrics = GatewayMetrics()
    refused = metrics.request(1.0)
    refused.klass = "interactive"
    refused.responded(status_of(RateLimited("slow down")))
    refused.finished(1.001)
    gone = metrics.request(2.0)
    gone.labelled("m", "batch")
    gone.responded(status_of(asyncio.CancelledError()))
    gone.finished(2.5)
    broken = metrics.request(3.0)
    broken.labelled("m", "batch")
    broken.responded(status_of(RuntimeError("a bug")))
    broken.responded(200)  # too late: the first status stands
    broken.finished(3.1)
    s = parse(metrics.render(STATS, RegistrySnapshot(version=0)))
    assert value(s, "hedgerow_requests_total", model="", status="429", **{"class": "interactive"}) == 1
    assert value(s, "hedgerow_requests_total", model="m", status=str(CLIENT_CLOSED)) == 1
    assert value(s, "hedgerow_requests_total", model="m", status="500") == 1
    assert value(s, "hedgerow_request_duration_seconds_count") == 0
    assert value(s, "hedgerow_ttft_seconds_count") == 0


def test_status_of_maps_errors_to_what_the_client_got() -> None:
    assert status_of(NoHealthyWorker("none")) == 503
    assert status_of(ValueError("bug")) == 500
    assert status_of(KeyboardInterrupt()) == CLIENT_CLOSED


def test_scheduler_snapshot_series_and_no_duplicate_families() -> None:
    metrics = GatewayMetrics()
    metrics.hedge_won()
    metrics.cache_lookup("miss")
    snapshot = RegistrySnapshot(version=1, workers=(record("w1", 2), record("w2", 4)))
    text = metrics.render(STATS, snapshot)
    s = parse(text)
    assert value(s, "hedgerow_shed_total", reason="concurrency") == 2
    assert value(s, "hedgerow_shed_total", reason="deadline") == 1
    assert value(s, "hedgerow_hedges_total", outcome="started") == 3
    assert value(s, "hedgerow_hedges_total", outcome="budget_exhausted") == 1
    assert value(s, "hedgerow_hedges_total", outcome="won") == 1
    assert value(s, "hedgerow_retries_total") == 4
    assert value(s, "hedgerow_breaker_transitions_total", to="open") == 1
    assert value(s, "hedgerow_breaker_state", worker="w1", state="open") == 1
    assert value(s, "hedgerow_breaker_state", worker="w1", state="closed") == 0
    assert value(s, "hedgerow_breaker_state", worker="w1", state="half_open") == 0
    assert value(s, "hedgerow_queue_depth", model="m") == 5
    assert value(s, "hedgerow_slots_in_use", worker="w2") == 1
    assert value(s, "hedgerow_slots", worker="w2") == 4
    assert value(s, "hedgerow_hedge_budget") == 2.5
    assert value(s, "hedgerow_cache_requests_total", result="miss") == 1
    names = family_names(text)
    assert len(names) == len(set(names))
    # A later scrape reads a later snapshot; nothing accumulates across scrapes.
    calmer = dict(STATS, queued={"m": 0})
    assert value(parse(metrics.render(calmer, snapshot)), "hedgerow_queue_depth", model="m") == 0


def test_two_gateways_in_one_process_keep_separate_numbers() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    streamed_request(first)
    empty = RegistrySnapshot(version=0)
    assert value(parse(first.render(STATS, empty)), "hedgerow_ttft_seconds_count") == 1
    assert value(parse(second.render(STATS, empty)), "hedgerow_ttft_seconds_count") == 0


# -- the worker ----------------------------------------------------------------------


def test_worker_generation_timings_and_outcomes() -> None:
    load = BackendLoad(slots=2, active=1, queued=3, tokens_per_s=42.5, generations_total=0,
                       cancelled_total=0, tokens_generated_total=17)
    metrics = WorkerMetrics(lambda: load, lambda: True)
    done = GenerationTiming(started=0.0)
    done.saw(TokenChunk("a"), 0.2)
    done.saw(TokenChunk("b"), 0.25)
    done.saw(TokenChunk("c"), 0.3)
    done.saw(Finished("length", 5, 3), 0.31)
    metrics.generation_done("m", done)
    left = GenerationTiming(started=1.0)
    left.saw(TokenChunk("a"), 1.5)
    metrics.generation_done("m", left)
    failed = GenerationTiming(started=2.0, failed=True)
    metrics.generation_done("m", failed)
    s = parse(metrics.render())
    assert value(s, "hedgerow_worker_prefill_seconds_count", model="m") == 2
    assert value(s, "hedgerow_worker_prefill_seconds_sum", model="m") == pytest.approx(0.7)
    assert value(s, "hedgerow_worker_decode_seconds_per_token_count", model="m") == 1
    assert value(s, "hedgerow_worker_decode_seconds_per_token_sum", model="m") == pytest.approx(0.05)
    for reason in ("length", "cancelled", "error"):
        assert value(s, "hedgerow_worker_generations_total", finish_reason=reason) == 1
    assert value(s, "hedgerow_worker_slots") == 2
    assert value(s, "hedgerow_worker_active") == 1
    assert value(s, "hedgerow_worker_queued") == 3
    # A rate is the scraper's to compute (rate(hedgerow_worker_tokens_total[1m])), not a gauge.
    assert not any(name == "hedgerow_worker_tokens_per_second" for name, _ in s)
    assert value(s, "hedgerow_worker_tokens_total") == 17
    assert value(s, "hedgerow_worker_draining") == 1


# -- the control plane ---------------------------------------------------------------


def test_control_plane_counts_workers_and_their_changes() -> None:
    published: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0))
    metrics = ControlPlaneMetrics(published)
    published.publish(RegistrySnapshot(version=1, workers=(record("a", 2), record("b", 1))), 1)
    metrics.registrations.inc(3)
    metrics.expiries.inc()
    with metrics.watchers.track_inprogress():
        s = parse(metrics.render())
    assert value(s, "hedgerow_control_plane_workers") == 2
    assert value(s, "hedgerow_control_plane_slots") == 3
    assert value(s, "hedgerow_control_plane_registrations_total") == 3
    assert value(s, "hedgerow_control_plane_lease_expiries_total") == 1
    assert value(s, "hedgerow_control_plane_deregistrations_total") == 0
    assert value(s, "hedgerow_control_plane_watchers") == 1
    assert value(parse(metrics.render()), "hedgerow_control_plane_watchers") == 0
