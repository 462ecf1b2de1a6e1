"""Choosing a worker for a request (sans-IO).

The foundation rule is least in-flight: among workers that serve the model
and are not draining, take the one with the fewest requests this gateway has
in flight to it, breaking ties by the load the worker reported and then by id
so the choice is deterministic. The scheduling issue replaces this with a
scored router; the signature stays.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    slots: int
    reported_active: int
    reported_queued: int
    draining: bool = False
    # Used by the scored router (policies.scoring); least-in-flight ignores them.
    kind: str = "cpu"  # "gpu" is the GPU pool; anything else is CPU/edge
    tokens_per_s: float = 0.0  # measured decode speed; 0 = not measured yet
    pop: str | None = None  # its "pop" label; used by policies.locality
    tier: str | None = None  # its "tier" label (quantization tier); used by policies.tiers


def pick_least_inflight(
    candidates: Sequence[Candidate],
    inflight: Mapping[str, int],
    exclude: Collection[str] = (),
) -> Candidate | None:
    """Return the candidate to use, or None when none is eligible."""
    eligible = [c for c in candidates if not c.draining and c.worker_id not in exclude]
    if not eligible:
        return None

    def key(c: Candidate) -> tuple[float, int, str]:
        ours = inflight.get(c.worker_id, 0)
        return (ours / c.slots, c.reported_active + c.reported_queued, c.worker_id)

    return min(eligible, key=key)
