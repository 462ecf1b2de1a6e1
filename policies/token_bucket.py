"""A token bucket: how much of a rate-limited resource may be used now (sans-IO).

The bucket refills continuously at ``rate_per_s`` up to ``burst`` and starts
full. Time is always a parameter (``now``, monotonic seconds); the first call
that passes a ``now`` starts the bucket's clock. A clock that appears to run
backwards is treated as standing still, so a level can never be conjured out
of a bad timestamp.

Invariant: ``0 <= level(now) <= burst`` at every observation. Requests for
more than ``burst`` can never be granted; ``time_until`` says so with
``math.inf`` and callers decide what that means for them.
"""

from __future__ import annotations

import math

# Float refills rarely land exactly on a whole amount: a take that is short by
# less than this is granted (and the level clamped at zero), so that waiting
# exactly ``time_until(amount)`` always suffices.
_EPSILON = 1e-9


class TokenBucket:
    """Tokens that refill at ``rate_per_s`` up to ``burst``; starts full."""

    def __init__(self, rate_per_s: float, burst: float) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
            raise ValueError(f"rate_per_s must be a positive number, not {rate_per_s!r}")
        if not (burst > 0 and math.isfinite(burst)):
            raise ValueError(f"burst must be a positive number, not {burst!r}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._level = burst
        self._last: float | None = None

    def level(self, now: float) -> float:
        """Tokens available at ``now``."""
        self._refill(now)
        return self._level

    def try_take(self, amount: float, now: float) -> bool:
        """Take ``amount`` tokens if they are all there; otherwise take nothing."""
        _check_amount(amount)
        self._refill(now)
        if amount > self._level + _EPSILON:
            return False
        self._level = max(0.0, self._level - amount)
        return True

    def drain(self, amount: float, now: float) -> float:
        """Take up to ``amount`` tokens, as many as there are; return how many were taken.

        For charging usage that has already happened (an under-estimate being
        settled): it cannot be refused, and the level never goes below zero.
        """
        _check_amount(amount)
        self._refill(now)
        taken = min(amount, self._level)
        self._level -= taken
        return taken

    def give_back(self, amount: float, now: float) -> None:
        """Return ``amount`` tokens (an over-estimate being settled); never above ``burst``."""
        _check_amount(amount)
        self._refill(now)
        self._level = min(self.burst, self._level + amount)

    def time_until(self, amount: float, now: float) -> float:
        """Seconds until ``try_take(amount)`` would succeed: 0 if now, ``inf`` if never."""
        _check_amount(amount)
        self._refill(now)
        if amount > self.burst + _EPSILON:
            return math.inf
        missing = amount - self._level
        return 0.0 if missing <= _EPSILON else missing / self.rate_per_s

    def _refill(self, now: float) -> None:
        if self._last is None:
            self._last = now
            return
        if now <= self._last:
            return
        self._level = min(self.burst, self._level + (now - self._last) * self.rate_per_s)
        self._last = now


def _check_amount(amount: float) -> None:
    if not (amount >= 0 and math.isfinite(amount)):
        raise ValueError(f"a token amount must be a finite number >= 0, not {amount!r}")
