"""PNG plots of measured latencies (matplotlib, Agg backend: no display needed).

``write_latency_plots(out_dir, groups, ...)`` takes, per group name, the
points ``(seconds since the run began, latency in seconds)`` and writes two
files into ``out_dir``: ``{prefix}_cdf.png`` (the latency CDF of each group,
log-scaled latency axis so both the body and the tail are readable) and
``{prefix}_over_time.png`` (each request's latency at its send time, to show
stalls and drift). It returns the paths written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: render to files, never to a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

Points = Sequence[tuple[float, float]]  # (seconds since the run began, latency seconds)


def write_latency_plots(out_dir: Path, groups: Mapping[str, Points], *, title: str,
                        metric: str, prefix: str | None = None) -> list[Path]:
    """Write the CDF and over-time PNGs of ``groups``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = prefix or metric.lower()
    paths = [out_dir / f"{stem}_cdf.png", out_dir / f"{stem}_over_time.png"]
    _write_cdf(paths[0], groups, title, metric)
    _write_over_time(paths[1], groups, title, metric)
    return paths


def _write_cdf(path: Path, groups: Mapping[str, Points], title: str, metric: str) -> None:
    figure, axes = plt.subplots(figsize=(8, 5))
    try:
        for name, points in groups.items():
            latencies = sorted(1000 * latency for _, latency in points)
            if not latencies:
                continue
            fractions = [(rank + 1) / len(latencies) for rank in range(len(latencies))]
            axes.step(latencies, fractions, where="post", label=f"{name} (n={len(latencies)})")
        _finish(axes, f"{title} — CDF", f"{metric} (ms)", "fraction of requests ≤ x")
        axes.set_xscale("log")
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)


def _write_over_time(path: Path, groups: Mapping[str, Points], title: str, metric: str) -> None:
    figure, axes = plt.subplots(figsize=(10, 5))
    try:
        for name, points in groups.items():
            if points:
                axes.scatter([at for at, _ in points], [1000 * latency for _, latency in points],
                             s=4, alpha=0.6, label=name)
        _finish(axes, f"{title} — over time", "send time (s since start)", f"{metric} (ms)")
        axes.set_yscale("log")
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)


def _finish(axes: Axes, title: str, xlabel: str, ylabel: str) -> None:
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, which="both", alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
