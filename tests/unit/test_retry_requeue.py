"""A retry with no free worker waits in its queue (sans-IO: the scheduler driven by hand).

``policies.scoring.retry_exclusions`` decides which workers a retry may not
be given; the scheduler's methods and ``tick`` are called directly with the
time passed in, so each test reads as a sequence of events and the
assignment the ticket got (or the error it was refused with).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.corridor.scheduler import Scheduler
from gateway.corridor.tickets import QUEUED, REQUEUED, Assigned, Ticket
from hedgerow.errors import NoHealthyWorker
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration
from policies.schema import Policy
from policies.scoring import RouteRequest, retry_exclusions

# -- the decision: which workers a retry may not be given ---------------------------


def test_tried_workers_are_excluded_while_an_untried_one_is_healthy() -> None:
    assert retry_exclusions(("a",), {"a", "b"}) == ("a",)
    assert retry_exclusions(("a", "b"), {"a", "b", "c"}) == ("a", "b")
    assert retry_exclusions(("a",), {"b"}) == ("a",)  # a's breaker opened: b it is


def test_with_only_tried_workers_healthy_just_the_last_failure_is_excluded() -> None:
    assert retry_exclusions(("a", "b"), {"a", "b"}) == ("b",)
    assert retry_exclusions(("a",), {"a"}) == ("a",)  # nothing left: no waiting for it
    assert retry_exclusions((), {"a"}) == ()


WORKERS = st.sampled_from("abcdef")


@given(st.lists(WORKERS, min_size=1, max_size=4, unique=True), st.sets(WORKERS))
def test_a_retry_never_goes_back_to_its_last_failure_and_prefers_untried_workers(
        tried: list[str], healthy: set[str]) -> None:
    excluded = retry_exclusions(tried, healthy)
    usable = healthy - set(excluded)
    assert tried[-1] in excluded
    assert set(excluded) <= set(tried)
    if healthy - set(tried):  # an untried worker is healthy: only untried ones may take it
        assert usable == healthy - set(tried)
    else:  # it may wait only when a worker other than the last failure is healthy
        assert usable == healthy - {tried[-1]}


# -- the scheduler: requeue, wait, assign, shed ------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def worker(wid: str) -> WorkerRecord:
    return WorkerRecord(
        registration=WorkerRegistration(worker_id=wid, url=f"http://{wid}.invalid", kind="cpu",
                                        models=("m",), slots=1),
        load=WorkerLoad(), lease_expires_in_s=30.0)


def scheduler(*wids: str, failures_to_open: int = 3) -> Scheduler:
    policy = Policy.model_validate({
        "scheduling": {"slo_admission": False},
        "hedging": {"budget_ratio": 1.0},
        "breaker": {"failures_to_open": failures_to_open}})
    directory = LatestValue(RegistrySnapshot(version=1, workers=tuple(map(worker, wids))), 1)
    return Scheduler(policy, directory)


def ticket(name: str, clock: Clock, *, deadline_s: float = 30.0) -> Ticket:
    return Ticket(request_id=name, tenant="local", model="m", arrival=clock.now,
                  due=clock.now + min(1.0, deadline_s), deadline=clock.now + deadline_s,
                  estimated_tokens=10,
                  route=RouteRequest(10), hedgeable=True)


def got(t: Ticket) -> str | None:
    """The worker ``t`` is assigned now, if any."""
    record = t.assignment.worker
    return None if record is None else record.registration.worker_id


def submitted(s: Scheduler, t: Ticket, now: float) -> str | None:
    decision = s.submit(t, now)
    assert decision is QUEUED or isinstance(decision, Assigned), decision
    assert (decision is QUEUED) == (got(t) is None)  # the answer says what the ticket got
    return got(t)


def failed_on(s: Scheduler, t: Ticket, now: float, *tried: str) -> Any:
    """The last of ``tried`` failed ``t`` before its first token: ask for a retry."""
    s.attempt_done(tried[-1], "failure", now)
    return s.reroute(t, tried, False, now)


@pytest.mark.anyio
async def test_a_retry_with_every_other_worker_busy_waits_for_the_next_free_one() -> None:
    clock = Clock()
    s = scheduler("a", "b")
    assert submitted(s, ticket("busy", clock), clock.now) == "a"
    clock.now += 0.1
    retried = ticket("retried", clock)
    assert submitted(s, retried, clock.now) == "b"
    assert failed_on(s, retried, clock.now, "b") is REQUEUED
    assert s.stats(clock.now)["queued"] == {"m": 1} and not retried.assignment.settled
    clock.now += 0.1
    s.tick(clock.now)
    assert got(retried) is None  # b is free, but it just failed this request
    # A fresh request may have b meanwhile: the retry does not hold up the queue.
    clock.now += 0.1
    assert submitted(s, ticket("fresh", clock), clock.now) == "b"
    later = ticket("later", clock)  # due after the retry (it arrived later)
    assert submitted(s, later, clock.now) is None
    s.attempt_done("a", "success", clock.now)
    assert got(retried) == "a" and got(later) is None  # EDF: the retry kept its due time
    counters = s.stats(clock.now)["counters"]
    assert counters["retries"] == 1 and counters["retries_queued"] == 1


@pytest.mark.anyio
async def test_a_retry_never_waits_for_the_worker_that_just_failed() -> None:
    clock = Clock()
    s = scheduler("a")
    only = ticket("only", clock)
    assert submitted(s, only, clock.now) == "a"
    assert failed_on(s, only, clock.now, "a") is None  # 503 at once, as before
    current = s.stats(clock.now)
    assert current["queued"] == {"m": 0} and current["inflight"] == {}
    assert current["counters"]["reroute_no_worker"] == 1


@pytest.mark.parametrize(("failures_to_open", "retried_on"), [(3, "a"), (1, None)])
@pytest.mark.anyio
async def test_when_only_tried_workers_are_healthy_an_earlier_one_may_take_the_retry(
        failures_to_open: int, retried_on: str | None) -> None:
    clock = Clock()
    s = scheduler("a", "b", failures_to_open=failures_to_open)
    t = ticket("t", clock)
    assert submitted(s, t, clock.now) == "a"
    assert got_worker(failed_on(s, t, clock.now, "a")) == "b"  # b was free: retried at once
    # b fails too. a failed once: with its breaker still closed it may have the request
    # again (not twice in a row); with its breaker open nothing healthy is left.
    assert got_worker(failed_on(s, t, clock.now, "a", "b")) == retried_on
    assert s.stats(clock.now)["queued"] == {"m": 0}


def got_worker(reply: Any) -> str | None:
    assert reply is None or isinstance(reply, WorkerRecord), reply
    return None if reply is None else reply.registration.worker_id


@pytest.mark.anyio
async def test_a_queued_retry_is_shed_at_its_deadline_like_any_queued_request() -> None:
    clock = Clock()
    s = scheduler("a", "b")
    assert submitted(s, ticket("busy", clock), clock.now) == "a"
    retried = ticket("retried", clock, deadline_s=0.5)
    assert submitted(s, retried, clock.now) == "b"
    assert failed_on(s, retried, clock.now, "b") is REQUEUED
    clock.now += 0.5
    s.tick(clock.now)
    with pytest.raises(NoHealthyWorker) as shed:
        await retried.assignment.wait()
    assert (shed.value.status, shed.value.code) == (503, "deadline_exceeded")
    s.attempt_done("a", "success", clock.now)
    current = s.stats(clock.now)
    assert current["queued"] == {"m": 0} and current["inflight"] == {}
    assert current["counters"]["shed_deadline"] == 1


@pytest.mark.anyio
async def test_a_client_leaving_while_its_retry_is_queued_withdraws_it() -> None:
    clock = Clock()
    s = scheduler("a", "b")
    assert submitted(s, ticket("busy", clock), clock.now) == "a"
    gone = ticket("gone", clock)
    assert submitted(s, gone, clock.now) == "b"
    assert failed_on(s, gone, clock.now, "b") is REQUEUED
    s.withdraw(gone, clock.now)
    s.attempt_done("a", "success", clock.now)
    assert got(gone) is None
    current = s.stats(clock.now)
    assert current["queued"] == {"m": 0} and current["inflight"] == {}


@pytest.mark.anyio
async def test_a_hedge_with_no_free_worker_is_refused_never_queued() -> None:
    clock = Clock()
    s = scheduler("a", "b")
    assert submitted(s, ticket("busy", clock), clock.now) == "a"
    slow = ticket("slow", clock)
    assert submitted(s, slow, clock.now) == "b"
    assert s.reroute(slow, ("b",), True, clock.now) is None
    current = s.stats(clock.now)
    assert current["queued"] == {"m": 0} and got(slow) == "b"  # its first worker, still
    assert current["counters"]["reroute_no_worker"] == 1
