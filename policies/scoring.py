"""Ranking the workers that could take a request, best first (sans-IO).

This replaces least-in-flight (``policies.routing``) for dispatch. The ranking
answers three questions in order:

1. **Which pool.** Long prompts (more than ``prefer_gpu_above_tokens``) are
   prefill-heavy and go to the GPU pool; CPU/edge workers get them only as
   fallback, and only when ``allow_cpu_fallback``. Short prompts go to
   CPU/edge workers first and overflow to GPU ones, keeping GPU slots for the
   work that needs them (set the threshold to 0 to send everything to GPU
   first). A worker is in the GPU pool when its ``kind`` is ``"gpu"``.
2. **Prefix affinity.** Requests with the same ``prefix_key`` (a hash of the
   conversation so far) go to the same worker while it has a free slot, so
   llama.cpp's prompt cache is reused. The worker is chosen by rendezvous
   (highest random weight) hashing over the pool's eligible workers: when a
   worker joins or leaves, only the prefixes it wins or held move.
3. **Expected delay.** The rest are ordered by ``(busy + 1) / (slots *
   speed)``: ``busy`` is the larger of our in-flight count and the worker's
   reported active count, plus its reported queue; ``speed`` is its measured
   tokens/s, or the pool's mean measured speed when it has not reported one.

Never returned: draining workers, excluded workers (already tried for this
request; ``retry_exclusions`` says which a retry avoids) and workers with no
free slot (our in-flight >= slots).

Before all three, a request whose class names a quantization tier
(``RouteRequest.tier``) ranks that tier's workers ahead of the rest, each
group ranked as above (``policies.tiers``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from policies.routing import Candidate
from policies.tiers import split_by_tier

GPU_KIND = "gpu"


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    prefix_key: str | None = None
    prefer_gpu_above_tokens: int = 512
    allow_cpu_fallback: bool = True
    tier: str | None = None  # the class's quantization tier: its workers first (policies.tiers)

    @property
    def is_long(self) -> bool:
        return self.prompt_tokens > self.prefer_gpu_above_tokens


def score_workers(
    candidates: Sequence[Candidate],
    request: RouteRequest,
    inflight: Mapping[str, int],
    exclude: Collection[str] = (),
) -> list[Candidate]:
    """The workers that may take ``request``, best first; empty when none may."""
    if request.tier is not None:  # the tier's workers first, each group ranked on its own
        return [ranked for group in split_by_tier(candidates, request.tier) for ranked in
                score_workers(group, replace(request, tier=None), inflight, exclude)]
    eligible = [c for c in candidates if _has_room(c, inflight, exclude)]
    gpu = [c for c in eligible if c.kind == GPU_KIND]
    cpu = [c for c in eligible if c.kind != GPU_KIND]
    if request.is_long:
        pools = [gpu, cpu] if request.allow_cpu_fallback else [gpu]
    else:
        pools = [cpu, gpu]
    ranked: list[Candidate] = []
    for pool in pools:
        ranked.extend(_rank_pool(pool, request.prefix_key, inflight))
    return ranked


def retry_exclusions(tried: Sequence[str], healthy: Collection[str]) -> tuple[str, ...]:
    """The workers a retry must not be given; ``tried`` in attempt order, the last one failed.

    Every tried worker while some healthy worker (breaker not open, not
    draining) has not been tried, busy or not: the retry waits for it. When
    only tried workers are healthy, just the last: its failure is why the
    request retries, so no worker gets the same request twice in a row, while
    one that failed earlier (its breaker still closed) may have it again.
    """
    if not tried or any(w not in tried for w in healthy):
        return tuple(tried)
    return (tried[-1],)


def affinity_weight(prefix_key: str, worker_id: str) -> int:
    """Rendezvous weight of a worker for a prefix; stable across processes."""
    digest = hashlib.blake2b(f"{prefix_key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity_owner(prefix_key: str, workers: Sequence[Candidate]) -> Candidate | None:
    """The worker with the highest rendezvous weight for ``prefix_key``."""
    return max(workers, key=lambda c: (affinity_weight(prefix_key, c.worker_id), c.worker_id),
               default=None)


def _has_room(c: Candidate, inflight: Mapping[str, int], exclude: Collection[str]) -> bool:
    return not c.draining and c.worker_id not in exclude and inflight.get(c.worker_id, 0) < c.slots


def _rank_pool(
    pool: Sequence[Candidate], prefix_key: str | None, inflight: Mapping[str, int]
) -> list[Candidate]:
    known = [c.tokens_per_s for c in pool if c.tokens_per_s > 0]
    default_speed = sum(known) / len(known) if known else 1.0

    def expected_delay(c: Candidate) -> tuple[float, str]:
        busy = max(inflight.get(c.worker_id, 0), c.reported_active) + c.reported_queued
        speed = c.tokens_per_s if c.tokens_per_s > 0 else default_speed
        return ((busy + 1) / (c.slots * speed), c.worker_id)

    ranked = sorted(pool, key=expected_delay)
    owner = None if prefix_key is None else affinity_owner(prefix_key, pool)
    if owner is None:
        return ranked
    return [owner, *(c for c in ranked if c is not owner)]
