"""When to hedge a slow first token, and how many hedges we can afford (sans-IO).

A straggling worker should cost the user nothing: if a request's first token
has not come after the pool's usual worst case (its pN TTFT), the same request
starts on a second worker and the first token wins. Hedges are extra load, so
a budget caps them at a fraction of requests.

``QuantileSketch`` keeps the most recent ``window`` TTFT samples of a pool in
a ring and answers quantiles exactly over that window (nearest rank). Memory
is bounded by ``window``; recency is the decay (a pool that slows down shows
it within ``window`` requests). Sorting on demand is cached until the next
sample, so a quantile per request costs one sort per observed sample at most.

``hedge_delay`` turns the sketch into a delay clamped to ``[floor_s,
ceiling_s]``. Before the sketch has ``min_samples`` it returns ``ceiling_s``:
a cold pool still rescues a request stuck past the ceiling, while hedging
nothing that is merely average.

``HedgeBudget`` earns ``ratio`` of a hedge per request seen, up to ``burst``,
and starts empty, so hedges spent never exceed ``ratio * requests``; ``burst``
only bounds how many saved-up hedges one burst of stragglers can use. A burst
below 1 can never hold a whole hedge: it turns hedging off.
"""

from __future__ import annotations

import math
from collections import deque

# Spending checks ``level >= 1``; summing 0.05 twenty times in floats can land
# just below 1, so a shortfall smaller than this still buys the hedge.
_EPSILON = 1e-9


class QuantileSketch:
    """Exact quantiles over the last ``window`` samples; ``None`` below ``min_samples``."""

    def __init__(self, window: int = 512, min_samples: int = 20) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, not {window!r}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window], not {min_samples!r}")
        self.window = window
        self.min_samples = min_samples
        self._ring: deque[float] = deque(maxlen=window)
        self._sorted: list[float] | None = None

    def __len__(self) -> int:
        return len(self._ring)

    def observe(self, value: float) -> None:
        """Record one sample (seconds); the oldest falls out once ``window`` are held."""
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"a sample must be finite and >= 0, not {value!r}")
        self._ring.append(value)
        self._sorted = None

    def quantile(self, q: float) -> float | None:
        """The smallest held sample with at least a ``q`` fraction of samples at or below it."""
        if not 0 <= q <= 1:
            raise ValueError(f"q must be in [0, 1], not {q!r}")
        if len(self._ring) < self.min_samples:
            return None
        if self._sorted is None:
            self._sorted = sorted(self._ring)
        rank = max(1, math.ceil(q * len(self._sorted)))
        return self._sorted[rank - 1]


def hedge_delay(sketch: QuantileSketch, q: float, floor_s: float, ceiling_s: float) -> float:
    """Seconds after dispatch to start a hedge if no first token has come.

    The sketch's ``q`` quantile clamped to ``[floor_s, ceiling_s]``, or
    ``ceiling_s`` while the sketch has too few samples.
    """
    if not 0 <= floor_s <= ceiling_s:
        raise ValueError(f"need 0 <= floor_s <= ceiling_s, not {floor_s!r}, {ceiling_s!r}")
    estimate = sketch.quantile(q)
    if estimate is None:
        return ceiling_s
    return min(max(estimate, floor_s), ceiling_s)


class HedgeBudget:
    """Hedges earned at ``ratio`` per request, held up to ``burst``; starts empty."""

    def __init__(self, ratio: float = 0.05, burst: float = 10.0) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError(f"ratio must be in [0, 1], not {ratio!r}")
        if not (burst >= 0 and math.isfinite(burst)):
            raise ValueError(f"burst must be finite and >= 0, not {burst!r}")
        self.ratio = ratio
        self.burst = burst
        self._level = 0.0
        self.requests_seen = 0
        self.hedges_spent = 0

    @property
    def level(self) -> float:
        """Hedges that could be spent now (fractional)."""
        return self._level

    def on_request(self) -> None:
        """A request was dispatched (hedges themselves do not count)."""
        self.requests_seen += 1
        self._level = min(self.burst, self._level + self.ratio)

    def try_spend(self) -> bool:
        """Take one hedge if a whole one is saved up."""
        if self._level + _EPSILON < 1.0:
            return False
        self._level = max(0.0, self._level - 1.0)
        self.hedges_spent += 1
        return True
