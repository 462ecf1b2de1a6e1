"""The gateway's scheduler: admission, EDF queues, routing, breakers, hedge budget.

A plain sans-IO object that the request path calls directly, with ``now``
passed in (aioquic's ``QuicConnection`` is the model): every method is
synchronous and returns its decision, and since it runs on the event loop
with no ``await`` inside, no two requests ever see half of an update. The
request path ``submit``s a ``Ticket`` and gets ``Assigned``, ``QUEUED`` or a
``Refused`` (a refusal touches no worker); a queued ticket waits on its
``assignment`` until the scheduler gives it a worker slot or sheds it. Every
attempt on a worker, the primary, a retry or a hedge, ends with exactly one
``attempt_done`` (success, failure or abandoned), which frees the slot, feeds
the worker's breaker and dispatches the next queued ticket. A retry that finds
no free worker goes back into the queue with its due time and deadline, and
is next assigned to a worker it has not tried
(``policies.scoring.retry_exclusions``). ``tick(now)`` sheds queued tickets
past their deadline and dispatches what the registry's changes made room for;
a small clock task drives it (``gateway.corridor.scheduling.SchedulerClock``). That
task can crash and be restarted without loss: the queues live here, not in
it. The decisions themselves are the sans-IO policies in ``policies/``; this
module only feeds them events and carries out their answers. It does no I/O
and imports no async library.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.corridor.tickets import (
    QUEUED,
    REQUEUED,
    Assigned,
    Outcome,
    Requeued,
    Submitted,
    Ticket,
)
from hedgerow.errors import HedgerowError, NoHealthyWorker
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerRecord
from policies.admission import Admission, Refused, WaitPredictor
from policies.breaker import BreakerConfig, BreakerState, BreakerTransition, CircuitBreaker
from policies.edf import EdfHandle, EdfQueue
from policies.hedging import HedgeBudget, QuantileSketch, hedge_delay
from policies.locality import HedgeRoom, LocalityRouter, RouteContext
from policies.routing import Candidate
from policies.schema import Policy
from policies.scoring import retry_exclusions, score_workers

log = logging.getLogger("hedgerow.gateway.scheduler")

NO_WORKER_RETRY_AFTER_S = 2.0
FIFO_HORIZON_S = 1e9
# HedgeBudget.try_spend forgives float shortfalls this small (0.1 added ten
# times is 0.9999999999999999); the affordability check must agree with it.
HEDGE_LEVEL_EPSILON = 1e-9


@dataclass(frozen=True)
class Capacity:
    slots: int
    busy: int


def admission_from(policy: Policy) -> Admission:
    limits = {t.name: t.limits for t in policy.tenants}
    return Admission(limits, max_queue=policy.scheduling.max_queue)


class Scheduler:
    def __init__(
        self,
        policy: Policy,
        directory: LatestValue[RegistrySnapshot],
        pop: str | None = None,
    ) -> None:
        self.policy = policy
        self.pop = pop  # this gateway's PoP (--pop); None: locality off
        self.locality = LocalityRouter(policy.topology, pop)
        self.failed_at: dict[str, float] = {}  # worker -> its last failure, until a success
        self.directory = directory
        self.admission = admission_from(policy)
        self.queues: dict[str, EdfQueue[Ticket]] = {}
        self.inflight: dict[str, int] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.sketches: dict[tuple[str, str], QuantileSketch] = {}
        self.predictors: dict[str, WaitPredictor] = {}
        h = policy.hedging
        self.hedge_budget = HedgeBudget(ratio=h.budget_ratio, burst=h.budget_burst)
        self.counters: dict[str, int] = {}
        self.transitions: list[BreakerTransition] = []
        # Told when a ticket enters a queue: the clock sleeps while none waits.
        self.on_queued: Callable[[], None] | None = None
        # Each model's workers as candidates, built once per registry snapshot
        # (a submit looks at them three to five times).
        self._serving_of: RegistrySnapshot | None = None
        self._serving: dict[str, tuple[tuple[Candidate, WorkerRecord], ...]] = {}

    # -- the request path's calls ---------------------------------------------

    def submit(self, ticket: Ticket, now: float) -> Submitted:
        """Admit and queue ``ticket``, and assign it a worker at once if one is free."""
        refusal = self._submit(ticket, now)
        if refusal is not None:
            return refusal
        worker = ticket.assignment.worker
        if worker is not None:
            return Assigned(worker)
        self._waits()
        return QUEUED

    def charge_request(self, tenant: str, now: float, tokens: float = 0.0) -> Refused | None:
        """Charge one request to ``tenant``'s requests/s now, before the cache answers
        it or it joins a flight (its ticket is then made with ``request_charged``);
        ``tokens``: also to its tokens/min, for a request no ticket will carry (an
        embedding; ``settle_tokens`` corrects it when it ends)."""
        refusal = self.admission.charge_request(tenant, now, tokens)
        self._count("requests_charged_at_door" if refusal is None else f"shed_{refusal.reason}")
        return refusal

    def settle_tokens(self, tenant: str, estimated: float, actual: float, now: float) -> None:
        """A request charged ``estimated`` tokens at the door used ``actual``."""
        self.admission.settle(tenant, estimated, actual, now)

    def withdraw(self, ticket: Ticket, now: float) -> None:
        """The client left while ``ticket`` waited for a worker, for its first attempt
        or a retry (still queued, or assigned a worker it will never use)."""
        if ticket.finished:
            return
        if ticket.handle is not None and self._queue(ticket.model).cancel(ticket.handle):
            self._finish_refused(ticket, now, NoHealthyWorker("client went away",
                                                              code="cancelled"))
        elif ticket.assignment.worker is not None:
            # Assigned just as the client left: no attempt will ever free the slot.
            self.attempt_done(ticket.assignment.worker.registration.worker_id, "abandoned", now)

    def first_token(self, model: str, pool: str, ttft_s: float) -> None:
        """A first token came from ``pool`` after ``ttft_s`` (feeds hedge timing)."""
        self._sketch(model, pool).observe(ttft_s)

    def hedge_delay(self, model: str, pool: str) -> float | None:
        """Seconds to wait for a first token before hedging on ``pool``; None: never."""
        h = self.policy.hedging
        if not h.enabled:
            return None
        return hedge_delay(self._sketch(model, pool), h.quantile, h.floor_ms / 1000,
                           h.ceiling_ms / 1000)

    def tick(self, now: float) -> None:
        """Shed queued tickets past their deadline; dispatch onto workers that appeared
        or came back since (the registry and breakers change without a call here)."""
        for model, queue in self.queues.items():
            for ticket in queue.expire(now):
                self._count("shed_deadline")
                self._finish_refused(ticket, now, NoHealthyWorker(
                    f"request {ticket.request_id} waited past its deadline for a worker",
                    code="deadline_exceeded", retry_after=1))
            self._dispatch(model, now)

    def reconfigure(self, policy: Policy) -> None:
        """Swap in a new policy without losing queued or running requests."""
        old, self.policy = self.policy, policy
        self.locality = LocalityRouter(policy.topology, self.pop)
        self.admission.reconfigure({t.name: t.limits for t in policy.tenants},
                                   max_queue=policy.scheduling.max_queue)
        for queue in self.queues.values():
            queue.capacity = policy.scheduling.max_queue
        if (old.hedging.budget_ratio, old.hedging.budget_burst) != (
                policy.hedging.budget_ratio, policy.hedging.budget_burst):
            self.hedge_budget = HedgeBudget(ratio=policy.hedging.budget_ratio,
                                            burst=policy.hedging.budget_burst)
        if old.breaker != policy.breaker or old.timeouts.ttft_ms != policy.timeouts.ttft_ms:
            self.breakers.clear()  # rebuilt closed, with the new settings, on next use
        log.info("scheduler now runs the new policy")

    # -- admission and queueing --------------------------------------------

    def _submit(self, ticket: Ticket, now: float) -> Refused | None:
        queue = self._queue(ticket.model)
        if self._capacity(ticket.model).slots == 0:
            self._count("shed_no_worker")
            return Refused(503, "no_healthy_worker", NO_WORKER_RETRY_AFTER_S,
                           f"no healthy worker serves {ticket.model!r} right now")
        refusal = self._admit(ticket, queue, now)
        if refusal is not None:
            self._count(f"shed_{refusal.reason}")
            return refusal
        self.hedge_budget.on_request()
        ticket.handle = self._push(queue, ticket, now)
        if ticket.handle is None:  # full even though admission passed (fifo mode)
            self._release_tenant(ticket, now, actual_tokens=0)
            self._count("shed_queue_full")
            return Refused(503, "queue_full", 1.0, "the queue for this model is full")
        self._dispatch(ticket.model, now)
        return None

    def _admit(self, ticket: Ticket, queue: EdfQueue[Ticket], now: float) -> Refused | None:
        scheduling = self.policy.scheduling
        capacity = self._capacity(ticket.model)
        ahead = queue.count_ahead(self._queue_key(ticket))
        wait = self._predictor(ticket.model).predict_wait(ahead, capacity.busy, capacity.slots)
        if not scheduling.slo_admission:
            wait = 0.0
        prefill = ticket.route.prompt_tokens * scheduling.prefill_ms_per_token / 1000
        left = ticket.deadline - now if scheduling.slo_admission else math.inf
        decision = self.admission.admit(
            ticket.tenant, ticket.estimated_tokens, wait, prefill if scheduling.slo_admission
            else 0.0, left, now, queue_length=len(queue) if scheduling.slo_admission else 0,
            charge_request=not ticket.request_charged)
        if isinstance(decision, Refused):
            return decision
        ticket.charged = decision.tokens_charged
        return None

    def _queue_key(self, ticket: Ticket) -> float:
        # FIFO mode (for comparison benchmarks) serves in arrival order.
        if self.policy.scheduling.order == "fifo":
            return ticket.arrival
        return ticket.deadline if ticket.due is None else ticket.due

    def waiting(self) -> bool:
        """Whether any ticket waits in a queue (else ``tick`` has nothing to do)."""
        return any(len(queue) for queue in self.queues.values())

    def _waits(self) -> None:
        """A ticket was left waiting in its queue: tell the clock."""
        if self.on_queued is not None:
            self.on_queued()

    def _push(self, queue: EdfQueue[Ticket], ticket: Ticket, now: float) -> EdfHandle | None:
        # FIFO mode never sheds: its deadlines are out of reach.
        fifo = self.policy.scheduling.order == "fifo"
        deadline = ticket.arrival + FIFO_HORIZON_S if fifo else ticket.deadline
        return queue.push(ticket, deadline, now, key=self._queue_key(ticket))

    def _queue(self, model: str) -> EdfQueue[Ticket]:
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = EdfQueue(self.policy.scheduling.max_queue)
        return queue

    # -- dispatch -------------------------------------------------------------

    def _dispatch(self, model: str, now: float) -> None:
        queue = self._queue(model)
        # Put back whatever is not assigned, also when a bug raises below: the
        # queues outlive every call, and a ticket dropped here would wait forever.
        passed_over: list[Ticket] = []
        try:
            while len(queue) and self._has_free_slot(model, now):
                ticket = queue.pop(now)
                if ticket is None:
                    break
                ticket.handle = None
                passed_over.append(ticket)
                worker = self._pick_queued(ticket, now)
                if worker is not None:
                    passed_over.pop()
                    self._assign(ticket, worker, now)
                    continue
                # A first dispatch held back (its route forbids the pool that has room,
                # or it waits for its PoP) keeps the head; a retry that may not use the
                # free workers (it failed there) lets the tickets behind it have them.
                if not ticket.tried:
                    break
        finally:
            for ticket in passed_over:
                self._put_back(queue, ticket, now)

    def _pick_queued(self, ticket: Ticket, now: float) -> WorkerRecord | None:
        if not ticket.tried:
            return self._pick(ticket, (), now, may_hold=True)
        return self._pick(ticket, self._retry_exclusions(ticket.model, ticket.tried, now), now)

    def _assign(self, ticket: Ticket, worker: WorkerRecord, now: float) -> None:
        if ticket.assigned_at is None:  # a retry's wait is not queue wait
            ticket.assigned_at = now
        ticket.assignment.give(worker)

    def _put_back(self, queue: EdfQueue[Ticket], ticket: Ticket, now: float) -> None:
        ticket.handle = self._push(queue, ticket, now)
        if ticket.handle is None:  # a new policy shrank the queue meanwhile
            self._count("shed_queue_full")
            self._finish_refused(ticket, now, NoHealthyWorker(
                "the queue for this model is full", code="queue_full", retry_after=1))

    def reroute(self, ticket: Ticket, exclude: tuple[str, ...], hedge: bool,
                 now: float) -> WorkerRecord | Requeued | None:
        """A worker for a retry or a hedge right now, or None.

        A hedge never queues. A retry with no free worker goes back into its
        model's queue (``REQUEUED``: wait on ``ticket.assignment`` again) while
        a healthy worker it may use exists; otherwise None."""
        if not hedge:
            return self._retry(ticket, exclude, now)
        if self.hedge_budget.level + HEDGE_LEVEL_EPSILON < 1.0:
            self._count("hedge_budget_exhausted")
            return None
        worker = self._pick(ticket, exclude, now, hedge=True)
        if worker is None:
            self._count("reroute_no_worker")
            return None
        self.hedge_budget.try_spend()
        self._count("hedges_started")
        return worker

    def _retry(self, ticket: Ticket, tried: tuple[str, ...],
               now: float) -> WorkerRecord | Requeued | None:
        """A free worker for a retry now, else the ticket back in its queue to wait for
        one; None when no healthy worker it may use is left to wait for."""
        exclude = self._retry_exclusions(ticket.model, tried, now)
        worker = self._pick(ticket, exclude, now)
        if worker is not None:
            self._count("retries")
            return worker
        if not set(self._healthy(ticket.model, now)) - set(exclude):
            self._count("reroute_no_worker")
            return None
        return self._requeue_for_retry(ticket, tried, now)

    def _requeue_for_retry(self, ticket: Ticket, tried: tuple[str, ...],
                           now: float) -> Requeued | None:
        # Same due time and deadline as on arrival: it keeps its place in EDF order
        # and is shed at its deadline like any queued ticket.
        ticket.requeue_for_retry(tried)
        ticket.handle = self._push(self._queue(ticket.model), ticket, now)
        if ticket.handle is None:
            self._count("reroute_queue_full")
            return None
        self._count("retries")
        self._count("retries_queued")
        self._waits()
        return REQUEUED

    def _retry_exclusions(self, model: str, tried: tuple[str, ...],
                          now: float) -> tuple[str, ...]:
        return retry_exclusions(tried, self._healthy(model, now))

    def _healthy(self, model: str, now: float) -> list[str]:
        """Workers serving ``model`` that could take work: breaker not open, not draining."""
        return [wid for wid, (c, _) in self._candidates(model, now).items() if not c.draining]

    def _candidates(self, model: str, now: float) -> dict[str, tuple[Candidate, WorkerRecord]]:
        """``model``'s workers whose breaker is not open, by worker id."""
        return {c.worker_id: (c, record) for c, record in self._serving_candidates(model)
                if self._breaker(c.worker_id).state(now) is not BreakerState.OPEN}

    def _serving_candidates(self, model: str) -> tuple[tuple[Candidate, WorkerRecord], ...]:
        snapshot = self.directory.value
        if snapshot is not self._serving_of:
            self._serving_of, self._serving = snapshot, {}
        serving = self._serving.get(model)
        if serving is None:
            serving = self._serving[model] = tuple(
                (_candidate(record), record) for record in snapshot.serving(model))
        return serving

    def _has_free_slot(self, model: str, now: float) -> bool:
        return any(self.inflight.get(wid, 0) < c.slots and not c.draining
                   for wid, (c, _) in self._candidates(model, now).items())

    def _pick(self, ticket: Ticket, exclude: tuple[str, ...], now: float, *,
              may_hold: bool = False, hedge: bool = False) -> WorkerRecord | None:
        candidates = self._candidates(ticket.model, now)
        everyone = [c for c, _ in candidates.values()]
        ranked = score_workers(everyone, ticket.route, self.inflight, exclude)
        ranked = self.locality.plan(ranked, everyone, self._route_context(
            ticket, now, may_hold=may_hold, hedge=hedge))
        for choice in ranked:
            if self._breaker(choice.worker_id).allow(now):
                self.inflight[choice.worker_id] = self.inflight.get(choice.worker_id, 0) + 1
                return candidates[choice.worker_id][1]
        return None

    def _route_context(self, ticket: Ticket, now: float, *, may_hold: bool,
                       hedge: bool) -> RouteContext:
        forget_after = self.policy.breaker.open_for_ms / 1000
        # Forgotten after the breaker's open time, so the map stays bounded by recent failures.
        self.failed_at = {w: at for w, at in self.failed_at.items() if now - at < forget_after}
        suspect = set(self.failed_at)
        room = None
        if hedge:
            medians = [s.quantile(0.5) for (m, _), s in self.sketches.items() if m == ticket.model]
            room = HedgeRoom(self.hedge_budget.level,
                             (ticket.deadline if ticket.due is None else ticket.due) - now,
                             min((m for m in medians if m is not None), default=0.0))
        return RouteContext(self.inflight, suspect, ticket.route.is_long,
                            self._predictor(ticket.model).mean_service_s,
                            now - ticket.arrival, may_hold, room, tier=ticket.route.tier)

    # -- completion -----------------------------------------------------------

    def attempt_done(self, worker_id: str, outcome: Outcome, now: float) -> None:
        """One attempt on ``worker_id`` ended: free its slot, feed its breaker, dispatch."""
        left = self.inflight.get(worker_id, 0) - 1
        if left > 0:
            self.inflight[worker_id] = left
        else:
            self.inflight.pop(worker_id, None)
        breaker = self._breaker(worker_id)
        if outcome == "success":
            breaker.on_success(now)
            self.failed_at.pop(worker_id, None)
        elif outcome == "failure":
            breaker.on_failure(now)
            self.failed_at[worker_id] = now
        else:
            breaker.on_abandoned(now)
        for model in self.queues:
            self._dispatch(model, now)

    def ticket_done(self, ticket: Ticket, actual_tokens: int, now: float) -> None:
        """The request is over; settle its tenant's tokens and concurrency."""
        if ticket.finished:
            return
        if ticket.assigned_at is not None:
            # How long a worker slot was held: what the wait prediction needs.
            self._predictor(ticket.model).observe_service(now - ticket.assigned_at)
        self._release_tenant(ticket, now, actual_tokens)

    def _release_tenant(self, ticket: Ticket, now: float, actual_tokens: int) -> None:
        if ticket.finished:
            return
        ticket.finished = True
        self.admission.settle(ticket.tenant, ticket.charged, actual_tokens, now)
        self.admission.release(ticket.tenant)

    def _finish_refused(self, ticket: Ticket, now: float, error: HedgerowError) -> None:
        ticket.handle = None
        ticket.assignment.refuse(error)
        self._release_tenant(ticket, now, actual_tokens=0)

    # -- state helpers --------------------------------------------------------

    def _breaker(self, worker_id: str) -> CircuitBreaker:
        breaker = self.breakers.get(worker_id)
        if breaker is None:
            b = self.policy.breaker
            config = BreakerConfig(failure_threshold=b.failures_to_open,
                                   open_for_s=b.open_for_ms / 1000,
                                   max_open_for_s=b.max_open_for_ms / 1000,
                                   probe_timeout_s=self.policy.timeouts.ttft_ms / 1000)
            breaker = self.breakers[worker_id] = CircuitBreaker(config, self._on_transition)
        return breaker

    def _on_transition(self, transition: BreakerTransition) -> None:
        self._count(f"breaker_to_{transition.to_state.name.lower()}")
        log.warning("breaker %s -> %s (%s)", transition.from_state.name,
                    transition.to_state.name, transition.cause.name)

    def _sketch(self, model: str, pool: str) -> QuantileSketch:
        key = (model, pool)
        sketch = self.sketches.get(key)
        if sketch is None:
            sketch = self.sketches[key] = QuantileSketch(
                min_samples=self.policy.hedging.min_samples)
        return sketch

    def _predictor(self, model: str) -> WaitPredictor:
        predictor = self.predictors.get(model)
        if predictor is None:
            predictor = self.predictors[model] = WaitPredictor()
        return predictor

    def _capacity(self, model: str) -> Capacity:
        serving = self._serving_candidates(model)
        slots = sum(c.slots for c, _ in serving if not c.draining)
        busy = sum(self.inflight.get(c.worker_id, 0) for c, _ in serving)
        return Capacity(slots, busy)

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def stats(self, now: float) -> dict[str, Any]:
        """A snapshot for /metrics and tests."""
        return {
            "breakers": {wid: b.state(now).name.lower() for wid, b in self.breakers.items()},
            "queued": {model: len(queue) for model, queue in self.queues.items()},
            "inflight": dict(self.inflight),
            "counters": dict(self.counters),
            "hedge_budget": {"level": self.hedge_budget.level,
                             "requests": self.hedge_budget.requests_seen,
                             "spent": self.hedge_budget.hedges_spent},
        }


def _candidate(record: WorkerRecord) -> Candidate:
    registration, load = record.registration, record.load
    return Candidate(
        worker_id=registration.worker_id, slots=registration.slots,
        reported_active=load.active, reported_queued=load.queued, draining=load.draining,
        kind=registration.kind, tokens_per_s=load.tokens_per_s,
        pop=registration.labels.get("pop"), tier=registration.labels.get("tier"))
