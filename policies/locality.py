"""Locality across PoPs: which PoP serves a request, and when to spill (sans-IO).

A gateway runs in one PoP (``hedgerow gateway --pop NAME``); a worker's PoP
is its ``pop`` label. A request served in its own PoP saves a WAN round trip,
so ``LocalityRouter.plan`` re-orders the scored ranking
(``policies.scoring.score_workers``) and may hold a request back:

1. **Order.** Workers that just failed (``suspect``) go last, whatever their
   PoP. The class's quantization tier stays ahead of other tiers
   (``policies.tiers``), and for long prompts headed for the GPU pool, GPU
   workers stay ahead of CPU ones (a remote GPU beats a local CPU at
   prefill-heavy work).
   Within that, the gateway's own PoP first, then the other PoPs in the
   policy's ``prefer`` order, then the rest nearest first. Inside one PoP the
   scored order is kept (prefix affinity, expected delay).
2. **Spill or hold.** When the best worker with a free slot is remote but the
   local pool has healthy workers that are only busy, the request waits for a
   local slot while the predicted local wait is no more than the WAN RTT plus
   the remote worker's own predicted wait plus ``spill_margin_ms``; past that
   (or once it has waited that long) it spills. A local pool with no healthy
   worker (none registered, all draining, breakers open, all just failed) is
   unhealthy: spill at once.
3. **Hedges.** A hedge may go to another PoP only when the hedge budget holds
   ``cross_pop_hedge_min_budget`` whole hedges and the time left before the
   request's first-token due time covers the RTT plus the predicted TTFT.

Workers without a ``pop`` label are local to every gateway. With no gateway
PoP, or ``topology.routing: blind``, the ranking passes through unchanged.
``topology.routing: local_only`` keeps every request (and hedge) in the
gateway's own PoP and never spills, even when the local pool is dead: each
PoP as a cluster of its own, the baseline multi-PoP routing is measured
against.
Waits are predicted like admission's (``policies.admission.WaitPredictor``):
requests beyond the free slots, spread over the slots, times the mean service
time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from policies.routing import Candidate
from policies.schema import Topology
from policies.scoring import GPU_KIND

# HedgeBudget.try_spend forgives float shortfalls this small.
BUDGET_EPSILON = 1e-9


@dataclass(frozen=True)
class HedgeRoom:
    """What a hedge may afford: budget left, time left, and what a first token takes."""

    budget_level: float
    time_left_s: float
    predicted_ttft_s: float


@dataclass(frozen=True)
class RouteContext:
    """The gateway's view when one request is routed."""

    inflight: Mapping[str, int]
    suspect: Collection[str] = ()  # workers whose last attempt failed, recently
    long_request: bool = False  # headed for the GPU pool first
    mean_service_s: float = 1.0  # how long a request holds a slot
    waited_s: float = 0.0  # how long this request has queued so far
    may_hold: bool = False  # a first dispatch may wait for a local slot; retries may not
    hedge: HedgeRoom | None = None  # set for a hedge
    tier: str | None = None  # the class's quantization tier (policies.tiers), if any


def pop_rtts(topology: Topology, local_pop: str) -> dict[str, float]:
    """Seconds of round trip from ``local_pop`` to every PoP the policy lists."""
    rtts = {p.name: topology.default_rtt_ms / 1000 for p in topology.pops if p.name != local_pop}
    for a, row in topology.rtt_ms.items():
        for b, rtt_ms in row.items():
            if local_pop in (a, b) and a != b:
                rtts[b if a == local_pop else a] = rtt_ms / 1000
    return rtts


def spill_order(topology: Topology, local_pop: str) -> tuple[str, ...]:
    """Other PoPs in the order this one spills to: ``prefer`` first, then nearest."""
    rtts = pop_rtts(topology, local_pop)
    preferred = next((p.prefer for p in topology.pops if p.name == local_pop), ())
    rest = sorted((name for name in rtts if name not in preferred), key=lambda n: (rtts[n], n))
    return (*preferred, *rest)


def predicted_wait_s(busy: int, slots: int, mean_service_s: float) -> float:
    """Seconds until one more request gets a slot, ``busy`` already holding or queued."""
    must_finish = busy - slots + 1
    if must_finish <= 0:
        return 0.0
    return must_finish / slots * mean_service_s


class LocalityRouter:
    def __init__(self, topology: Topology, local_pop: str | None) -> None:
        self.local_pop = local_pop
        self.enabled = local_pop is not None and topology.routing == "local_first"
        self.local_only = local_pop is not None and topology.routing == "local_only"
        self.default_rtt_s = topology.default_rtt_ms / 1000
        self.spill_margin_s = topology.spill_margin_ms / 1000
        self.min_hedge_budget = topology.cross_pop_hedge_min_budget
        if local_pop is None:
            self.rtts: dict[str, float] = {}
            self.order: tuple[str, ...] = ()
        else:
            self.rtts = pop_rtts(topology, local_pop)
            self.order = spill_order(topology, local_pop)

    def is_local(self, c: Candidate) -> bool:
        return c.pop is None or c.pop == self.local_pop

    def rtt_to(self, pop: str | None) -> float:
        if pop is None or pop == self.local_pop:
            return 0.0
        return self.rtts.get(pop, self.default_rtt_s)

    def pop_rank(self, pop: str | None) -> int:
        if pop is None or pop == self.local_pop:
            return 0
        return 1 + (self.order.index(pop) if pop in self.order else len(self.order))

    def plan(self, ranked: Sequence[Candidate], everyone: Sequence[Candidate],
             ctx: RouteContext) -> list[Candidate]:
        """``ranked`` (workers with room, best first) re-ordered for locality; empty
        when the request should wait for a local slot instead.

        ``everyone`` is every usable worker for the model, full or not: the
        local pool's load is read from it."""
        if self.local_only:
            return [c for c in ranked if self.is_local(c)]
        if not self.enabled:
            return list(ranked)
        ordered = sorted(ranked, key=lambda c: self._order_key(c, ctx))
        if ctx.hedge is not None:
            return [c for c in ordered if self.may_hedge_to(c, ctx.hedge)]
        if ordered and ctx.may_hold and self.hold_for_local(ordered[0], everyone, ctx):
            return []
        return ordered

    def hold_for_local(self, first: Candidate, everyone: Sequence[Candidate],
                       ctx: RouteContext) -> bool:
        """Whether waiting for a busy local worker beats sending to remote ``first``."""
        if self.is_local(first):
            return False
        def same_group(c: Candidate) -> bool:  # what could have ranked where ``first`` did
            return ((c.kind == GPU_KIND) == (first.kind == GPU_KIND)
                    and _other_tier(c, ctx) == _other_tier(first, ctx))

        local = [c for c in everyone if self.is_local(c) and not c.draining
                 and c.worker_id not in ctx.suspect and same_group(c)]
        slots = sum(c.slots for c in local)
        if slots == 0:  # unhealthy or absent: nothing local to wait for
            return False
        busy = sum(_busy(c, ctx.inflight) for c in local)
        local_wait = predicted_wait_s(busy, slots, ctx.mean_service_s)
        remote_wait = predicted_wait_s(_busy(first, ctx.inflight), first.slots, ctx.mean_service_s)
        spill_cost = self.rtt_to(first.pop) + remote_wait + self.spill_margin_s
        return local_wait <= spill_cost and ctx.waited_s < spill_cost

    def may_hedge_to(self, c: Candidate, room: HedgeRoom) -> bool:
        if self.is_local(c):
            return True
        if room.budget_level + BUDGET_EPSILON < self.min_hedge_budget:
            return False
        return room.time_left_s > self.rtt_to(c.pop) + room.predicted_ttft_s

    def _order_key(self, c: Candidate, ctx: RouteContext) -> tuple[bool, bool, bool, int]:
        cpu_for_long = ctx.long_request and c.kind != GPU_KIND
        return (c.worker_id in ctx.suspect, _other_tier(c, ctx), cpu_for_long,
                self.pop_rank(c.pop))


def _other_tier(c: Candidate, ctx: RouteContext) -> bool:
    return ctx.tier is not None and c.tier != ctx.tier


def _busy(c: Candidate, inflight: Mapping[str, int]) -> int:
    return max(inflight.get(c.worker_id, 0), c.reported_active) + c.reported_queued
