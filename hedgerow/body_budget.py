"""One budget for the request bodies a process is reading at once (sans-IO).

Each request's body is bounded on its own (the policy's ``max_body_bytes``,
1 MiB by default), but not all of them together: a few thousand connections
each sending a large body slowly hold gigabytes while they are buffered. The
budget counts the bytes buffered across every body being read; a chunk that
would take it past ``limit_bytes`` is refused, and so is a body whose
declared length does not fit in what is free, before any of it is read. The
caller answers those with a quick 503 (``BodyBudgetExhausted``, Retry-After),
never by waiting. A body's bytes are given back as soon as it has been read
(or refused): the budget bounds the buffering, not the request's life.
"""

from __future__ import annotations

from typing import Any

DEFAULT_BODY_BUDGET_BYTES = 64 * 1024 * 1024


class BodyBudget:
    """Bytes of request bodies buffered now, against a limit."""

    def __init__(self, limit_bytes: int = DEFAULT_BODY_BUDGET_BYTES) -> None:
        if limit_bytes < 1:
            raise ValueError(f"the body budget must be >= 1 byte, not {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self.in_use = 0
        self.peak = 0
        self.refused = 0

    @property
    def free(self) -> int:
        return self.limit_bytes - self.in_use

    def fits(self, size: int) -> bool:
        """Whether a body of ``size`` bytes could be buffered now (reserves nothing);
        counted as a refusal when not."""
        if size <= self.free:
            return True
        self.refused += 1
        return False

    def try_reserve(self, size: int) -> bool:
        """Take ``size`` bytes for a chunk being buffered; False (counted): over the budget."""
        if size < 0:
            raise ValueError("a reservation cannot be negative")
        if size > self.free:
            self.refused += 1
            return False
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return True

    def release(self, size: int) -> None:
        if not 0 <= size <= self.in_use:
            raise RuntimeError(f"released {size} bytes of a budget holding {self.in_use}")
        self.in_use -= size

    def stats(self) -> dict[str, Any]:
        return {"in_use": self.in_use, "limit": self.limit_bytes, "peak": self.peak,
                "refused": self.refused}
