"""Quantization tiers: which workers a class of traffic prefers (sans-IO).

One model may be served in several GGUF quantizations, e.g. a small fast Q4
and a larger, more accurate Q8. Each worker advertises its variant as its
``tier`` label (``hedgerow worker --tier fast``); a priority class names the
tier it prefers (``classes[].tier`` in the policy: interactive → fast,
premium → accurate). ``policies.scoring.score_workers`` ranks the class's
tier first and everyone else after it, each group ranked as usual (GPU/CPU
pools, prefix affinity, expected delay), so the preference is soft: when no
worker of the tier has a free slot, or none is registered, the request is
served by another tier rather than refused or queued.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing import Candidate


def split_by_tier(
    candidates: Sequence[Candidate], tier: str
) -> tuple[list[Candidate], list[Candidate]]:
    """(workers of ``tier``, all the others), each in the order given."""
    matching = [c for c in candidates if c.tier == tier]
    others = [c for c in candidates if c.tier != tier]
    return matching, others
