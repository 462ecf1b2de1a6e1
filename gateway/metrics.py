"""Rendering the gateway's scheduler statistics as Prometheus text (sans-IO).

Labels are bounded: models, workers, reasons and states, never requests or
keys. The observability issue adds latency histograms; this is the part the
scheduler already knows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

BREAKER_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    if not labels:
        return f"{name} {value:g}"
    inner = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
    return f"{name}{{{inner}}} {value:g}"


def _family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def render(stats: Mapping[str, Any]) -> str:
    counters: Mapping[str, int] = stats["counters"]
    shed = {k.removeprefix("shed_"): v for k, v in counters.items() if k.startswith("shed_")}
    breaker_to = {k.removeprefix("breaker_to_"): v for k, v in counters.items()
                  if k.startswith("breaker_to_")}
    lines: list[str] = []
    lines += _family("hedgerow_shed_total", "counter", "Requests refused or shed, by reason.",
                     (_sample("hedgerow_shed_total", {"reason": r}, n) for r, n in sorted(shed.items())))
    lines += _family("hedgerow_hedges_total", "counter", "Hedged attempts started.",
                     [_sample("hedgerow_hedges_total", {"outcome": "started"},
                              counters.get("hedges_started", 0))])
    lines += _family("hedgerow_retries_total", "counter",
                     "Attempts retried on another worker before the first token.",
                     [_sample("hedgerow_retries_total", {}, counters.get("retries", 0))])
    lines += _family("hedgerow_breaker_transitions_total", "counter",
                     "Circuit breaker state changes, by new state.",
                     (_sample("hedgerow_breaker_transitions_total", {"to": s}, n)
                      for s, n in sorted(breaker_to.items())))
    lines += _family("hedgerow_breaker_state", "gauge", "0 closed, 1 half-open, 2 open.",
                     (_sample("hedgerow_breaker_state", {"worker": w}, BREAKER_STATE_VALUE[s])
                      for w, s in sorted(stats["breakers"].items())))
    lines += _family("hedgerow_queue_depth", "gauge", "Requests waiting for a worker slot.",
                     (_sample("hedgerow_queue_depth", {"model": m}, n)
                      for m, n in sorted(stats["queued"].items())))
    lines += _family("hedgerow_worker_inflight", "gauge", "Attempts in flight per worker.",
                     (_sample("hedgerow_worker_inflight", {"worker": w}, n)
                      for w, n in sorted(stats["inflight"].items())))
    budget = stats["hedge_budget"]
    lines += _family("hedgerow_hedge_budget", "gauge", "Hedges that could be started now.",
                     [_sample("hedgerow_hedge_budget", {}, round(budget["level"], 3))])
    return "\n".join(lines) + "\n"
