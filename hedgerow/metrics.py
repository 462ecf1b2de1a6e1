"""Prometheus metrics shared by the three process kinds.

Each app owns its own ``CollectorRegistry`` (never the global default), so
several apps in one process (tests) keep separate numbers. Counters and
gauges are prometheus-client's own. Latency histograms are ``Histogram``
below: a prometheus-client collector whose ``observe`` is a bisect and two
additions, without prometheus-client's per-call lock (about 2 µs) — they are
observed once per relayed token, always from the process's one event loop
thread.

Label values must come from bounded sets (models, classes, workers,
statuses, reasons), never from requests or keys; each histogram also caps
its number of series and folds the excess into one ``_other`` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

# End to end, TTFT, queue wait: a millisecond up to a few minutes.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
# Gaps between tokens and time per decoded token.
TOKEN_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)
# What the gateway itself adds: tens of microseconds up to a second.
OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)

MAX_SERIES = 256
OTHER = "_other"


class HistogramSeries:
    """One labelled series: bucket counts (the last is +Inf) and the sum."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are "less than or equal": bisect_left puts a value
        # equal to a bound into that bound's bucket.
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self._bounds, float("inf")), self.counts):
            running += count
            out.append((_le(bound), float(running)))
        return out


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it: ``+Inf``, ``0.005``, ``1.0``."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


class Histogram(Collector):
    """A labelled latency histogram for one event loop (see the module docstring)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: tuple[float, ...], registry: CollectorRegistry,
                 max_series: int = MAX_SERIES) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("buckets must be distinct and ascending")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.buckets = buckets
        self.max_series = max_series
        self._series: dict[tuple[str, ...], HistogramSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> HistogramSeries:
        """The series for these label values; resolve once, then ``observe`` on it."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} wants labels {self.labelnames}, got {values}")
        series = self._series.get(values)
        if series is None:
            if len(self._series) >= self.max_series:
                values = (OTHER,) * len(values)
                series = self._series.get(values)
            if series is None:
                series = self._series[values] = HistogramSeries(self.buckets)
        return series

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in sorted(self._series.items()):
            family.add_metric(list(values), series.cumulative(), series.total)
        yield family


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format."""
    return generate_latest(registry)
