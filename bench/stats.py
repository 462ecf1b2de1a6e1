"""Percentiles and latency summaries (sans-IO, plain numbers).

Percentiles use the nearest-rank method: the p-th percentile of n values is
the value at 1-based rank ``ceil(p / 100 × n)`` of the sorted values. It is
always a value that was observed (never an interpolation between two), and
with fewer than 1000 samples p99.9 is simply the maximum — which is the
honest answer for a tail that small a sample cannot resolve.

Summaries report latencies in milliseconds under the keys ``p50``, ``p95``,
``p99``, ``p999`` (p99.9), plus ``count``, ``min`` and ``max``; never a mean,
because latency is judged by its percentiles.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

PERCENTILES: tuple[float, ...] = (50.0, 95.0, 99.0, 99.9)

LatencySummary = dict[str, float | int | None]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError("q must be in (0, 100]")
    # Rounded first so float noise (99.9 / 100 × 1000 = 999.0000000000001) cannot bump the rank.
    rank = math.ceil(round(q / 100 * len(sorted_values), 9))
    return sorted_values[max(rank, 1) - 1]


def percentile_key(q: float) -> str:
    """``50.0`` → ``"p50"``, ``99.9`` → ``"p999"``."""
    return "p" + f"{q:g}".replace(".", "")


def summarize_ms(seconds: Iterable[float]) -> LatencySummary:
    """count, min, p50, p95, p99, p999 and max of durations given in seconds, in ms."""
    values = sorted(seconds)
    summary: LatencySummary = {"count": len(values)}
    if not values:
        summary.update({"min": None, **{percentile_key(q): None for q in PERCENTILES}, "max": None})
        return summary
    summary["min"] = _ms(values[0])
    for q in PERCENTILES:
        summary[percentile_key(q)] = _ms(percentile(values, q))
    summary["max"] = _ms(values[-1])
    return summary


def fraction_at_most(values: Iterable[float | None], limit: float) -> float:
    """Share of ``values`` that are known and ``<= limit``; a missing value counts as a miss.

    SLO attainment, for example: ``fraction_at_most(ttfts, slo_s)`` over all
    requests of a class, so a refused or failed request counts against it.
    """
    items = list(values)
    if not items:
        return 0.0
    return sum(1 for value in items if value is not None and value <= limit) / len(items)


def tally(items: Iterable[str]) -> dict[str, int]:
    """How often each string occurs, keys sorted (stable JSON)."""
    return dict(sorted(Counter(items).items()))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
