"""Locality across PoPs: local first, spill when it pays, cross-PoP hedges only when affordable."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.corridor.scheduler import Scheduler
from gateway.corridor.tickets import QUEUED, Assigned, Ticket
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration
from policies.locality import (
    HedgeRoom,
    LocalityRouter,
    RouteContext,
    pop_rtts,
    predicted_wait_s,
    spill_order,
)
from policies.routing import Candidate
from policies.schema import Policy, PolicyError, Topology, parse_policy
from policies.scoring import RouteRequest, score_workers

TOPOLOGY = Topology.model_validate({
    "pops": [{"name": "ams", "region": "eu", "prefer": ["lon"]},
             {"name": "fra", "region": "eu"},
             {"name": "lon", "region": "uk"},
             {"name": "nyc", "region": "us"}],
    "rtt_ms": {"ams": {"fra": 10, "lon": 30, "nyc": 80}},
})


def worker(wid: str, pop: str | None, *, slots: int = 2, active: int = 0, kind: str = "cpu",
           speed: float = 0.0) -> Candidate:
    return Candidate(worker_id=wid, slots=slots, reported_active=active, reported_queued=0,
                     kind=kind, tokens_per_s=speed, pop=pop)


def ids(cs: list[Candidate]) -> list[str]:
    return [c.worker_id for c in cs]


AMS = LocalityRouter(TOPOLOGY, "ams")


def test_spill_order_follows_prefer_then_nearest() -> None:
    assert spill_order(TOPOLOGY, "ams") == ("lon", "fra", "nyc")
    assert pop_rtts(TOPOLOGY, "lon")["ams"] == pytest.approx(0.030)  # either direction
    assert pop_rtts(TOPOLOGY, "lon")["fra"] == pytest.approx(0.050)  # not listed: default


def test_local_workers_first_even_when_a_remote_one_scores_better() -> None:
    everyone = [worker("fra-fast", "fra", speed=100), worker("ams-slow", "ams", speed=10),
                worker("lon-1", "lon", speed=50), worker("anywhere", None, speed=1)]
    ranked = score_workers(everyone, RouteRequest(50), {})
    assert ids(ranked)[0] == "fra-fast"  # the blind ranking
    assert ids(AMS.plan(ranked, everyone, RouteContext({}))) == [
        "ams-slow", "anywhere", "lon-1", "fra-fast"]


def test_blind_mode_or_no_gateway_pop_keeps_the_scored_order() -> None:
    everyone = [worker("fra-1", "fra", speed=100), worker("ams-1", "ams", speed=10)]
    ranked = score_workers(everyone, RouteRequest(50), {})
    blind = LocalityRouter(TOPOLOGY.model_copy(update={"routing": "blind"}), "ams")
    assert blind.plan(ranked, everyone, RouteContext({})) == ranked
    assert LocalityRouter(TOPOLOGY, None).plan(ranked, everyone, RouteContext({})) == ranked


def test_local_only_never_leaves_the_pop_even_when_the_local_pool_is_dead() -> None:
    only = LocalityRouter(TOPOLOGY.model_copy(update={"routing": "local_only"}), "ams")
    everyone = [worker("fra-1", "fra", speed=100), worker("ams-1", "ams", speed=10),
                worker("anywhere", None)]
    ranked = score_workers(everyone, RouteRequest(50), {})
    assert sorted(ids(only.plan(ranked, everyone, RouteContext({})))) == ["ams-1", "anywhere"]
    dead = RouteContext({}, suspect={"ams-1"}, may_hold=True)
    remote = [c for c in ranked if c.pop == "fra"]
    assert only.plan(remote, everyone, dead) == []  # waits (or times out) at home
    hedge = RouteContext({}, hedge=HedgeRoom(budget_level=10, time_left_s=10, predicted_ttft_s=0))
    assert sorted(ids(only.plan(ranked, everyone, hedge))) == ["ams-1", "anywhere"]


def busy_local_and_free_remote(remote_pop: str) -> tuple[list[Candidate], list[Candidate]]:
    everyone = [worker("ams-1", "ams", slots=1), worker(f"{remote_pop}-1", remote_pop, slots=1)]
    inflight = {"ams-1": 1}
    return score_workers(everyone, RouteRequest(50), inflight), everyone


def test_waits_for_a_local_slot_when_that_is_sooner_than_the_wan_round_trip() -> None:
    ranked, everyone = busy_local_and_free_remote("nyc")
    # A local slot frees in ~50 ms on average; the WAN costs 80 ms.
    ctx = RouteContext({"ams-1": 1}, mean_service_s=0.05, may_hold=True)
    assert AMS.plan(ranked, everyone, ctx) == []
    # A retry never waits: it goes remote.
    assert ids(AMS.plan(ranked, everyone, RouteContext({"ams-1": 1}, mean_service_s=0.05))) == [
        "nyc-1"]


def test_spills_when_the_local_wait_exceeds_rtt_plus_remote_wait() -> None:
    ranked, everyone = busy_local_and_free_remote("fra")
    ctx = RouteContext({"ams-1": 1}, mean_service_s=0.5, may_hold=True)
    assert ids(AMS.plan(ranked, everyone, ctx)) == ["fra-1"]


def test_a_held_request_spills_once_it_has_waited_as_long_as_spilling_costs() -> None:
    ranked, everyone = busy_local_and_free_remote("nyc")
    ctx = RouteContext({"ams-1": 1}, mean_service_s=0.05, may_hold=True, waited_s=0.081)
    assert ids(AMS.plan(ranked, everyone, ctx)) == ["nyc-1"]


def test_spill_margin_keeps_requests_home() -> None:
    ranked, everyone = busy_local_and_free_remote("fra")
    sticky = LocalityRouter(TOPOLOGY.model_copy(update={"spill_margin_ms": 1000.0}), "ams")
    ctx = RouteContext({"ams-1": 1}, mean_service_s=0.5, may_hold=True)
    assert sticky.plan(ranked, everyone, ctx) == []


def test_an_unhealthy_local_pool_spills_at_once() -> None:
    ranked, everyone = busy_local_and_free_remote("nyc")
    # ams-1 just failed: nothing healthy to wait for.
    ctx = RouteContext({"ams-1": 1}, suspect={"ams-1"}, mean_service_s=0.05, may_hold=True)
    assert ids(AMS.plan(ranked, everyone, ctx)) == ["nyc-1"]
    draining = [replace(everyone[0], draining=True), everyone[1]]
    ctx = RouteContext({}, mean_service_s=0.05, may_hold=True)
    assert ids(AMS.plan([everyone[1]], draining, ctx)) == ["nyc-1"]


def test_workers_that_just_failed_go_after_every_other_pop() -> None:
    everyone = [worker("ams-1", "ams"), worker("ams-2", "ams"), worker("fra-1", "fra")]
    ranked = score_workers(everyone, RouteRequest(50), {})
    ctx = RouteContext({}, suspect={"ams-1", "ams-2"})
    assert ids(AMS.plan(ranked, everyone, ctx)) == ["fra-1", "ams-1", "ams-2"]
    ctx = RouteContext({}, suspect={"ams-1"})
    assert ids(AMS.plan(ranked, everyone, ctx)) == ["ams-2", "fra-1", "ams-1"]


def test_long_prompts_take_a_remote_gpu_before_a_local_cpu() -> None:
    everyone = [worker("ams-cpu", "ams"), worker("fra-gpu", "fra", kind="gpu"),
                worker("nyc-gpu", "nyc", kind="gpu")]
    ranked = score_workers(everyone, RouteRequest(2000), {})
    ctx = RouteContext({}, long_request=True, may_hold=True)
    assert ids(AMS.plan(ranked, everyone, ctx)) == ["fra-gpu", "nyc-gpu", "ams-cpu"]


def test_hedges_cross_pops_only_when_budget_and_deadline_allow() -> None:
    everyone = [worker("ams-1", "ams"), worker("fra-1", "fra")]
    ranked = score_workers(everyone, RouteRequest(50), {})
    rich = HedgeRoom(budget_level=2.0, time_left_s=1.0, predicted_ttft_s=0.1)
    assert ids(AMS.plan(ranked, everyone, RouteContext({}, hedge=rich))) == ["ams-1", "fra-1"]
    poor = HedgeRoom(budget_level=1.5, time_left_s=1.0, predicted_ttft_s=0.1)
    assert ids(AMS.plan(ranked, everyone, RouteContext({}, hedge=poor))) == ["ams-1"]
    late = HedgeRoom(budget_level=5.0, time_left_s=0.105, predicted_ttft_s=0.1)
    assert ids(AMS.plan(ranked, everyone, RouteContext({}, hedge=late))) == ["ams-1"]


def test_predicted_wait() -> None:
    assert predicted_wait_s(busy=3, slots=4, mean_service_s=1.0) == 0.0
    assert predicted_wait_s(busy=4, slots=4, mean_service_s=1.0) == pytest.approx(0.25)
    assert predicted_wait_s(busy=8, slots=4, mean_service_s=1.0) == pytest.approx(1.25)


def test_topology_policy_rejects_what_it_cannot_mean() -> None:
    with pytest.raises(PolicyError) as error:
        parse_policy("topology:\n  pops:\n    - {name: ams, region: eu, prefer: [ams, osl]}\n"
                     "  rtt_ms:\n    ams: {fra: 10}\n")
    text = str(error.value)
    assert "topology.pops[0].prefer[0]" in text and "topology.pops[0].prefer[1]" in text
    assert "topology.rtt_ms.ams.fra" in text and "unknown pop" in text
    with pytest.raises(PolicyError, match="given twice with different values"):
        parse_policy("topology:\n  pops: [{name: a, region: r}, {name: b, region: r}]\n"
                     "  rtt_ms: {a: {b: 10}, b: {a: 12}}\n")
    assert parse_policy("topology:\n  pops: [{name: a, region: r}, {name: b, region: r}]\n"
                        "  rtt_ms: {a: {b: 10}, b: {a: 10}}\n").topology.rtt_ms["b"]["a"] == 10


POPS = ["ams", "fra", "lon", "nyc", None]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Candidate], dict[str, int], set[str]]:
    n = draw(st.integers(1, 8))
    everyone = [worker(f"w{i}", draw(st.sampled_from(POPS)), slots=draw(st.integers(1, 3)),
                       active=draw(st.integers(0, 3)), kind=draw(st.sampled_from(["cpu", "gpu"])))
                for i in range(n)]
    inflight = {c.worker_id: draw(st.integers(0, c.slots)) for c in everyone}
    suspect = {c.worker_id for c in everyone if draw(st.booleans())}
    return everyone, inflight, suspect


@given(fleets(), st.booleans(), st.floats(0, 2), st.floats(0, 1))
def test_plan_is_a_reordering_with_healthy_local_first(
        fleet: tuple[list[Candidate], dict[str, int], set[str]], long: bool,
        service_s: float, waited_s: float) -> None:
    everyone, inflight, suspect = fleet
    ranked = score_workers(everyone, RouteRequest(2000 if long else 50), inflight)
    ctx = RouteContext(inflight, suspect, long, service_s, waited_s, may_hold=True)
    plan = AMS.plan(ranked, everyone, ctx)
    if ranked and not plan:  # held: only ever when the best choice is remote
        unheld = AMS.plan(ranked, everyone, RouteContext(inflight, suspect, long, service_s,
                                                          waited_s))
        assert unheld[0].pop not in ("ams", None)
        return
    assert sorted(ids(plan)) == sorted(ids(ranked))
    healthy = [c for c in plan if c.worker_id not in suspect]
    assert plan[:len(healthy)] == healthy  # a worker that just failed never beats one that did not
    if not long:
        ranks = [AMS.pop_rank(c.pop) for c in healthy]
        assert ranks == sorted(ranks)  # own PoP, then the spill order


# -- the scheduler wires it in ------------------------------------------------------


def record(wid: str, pop: str) -> WorkerRecord:
    return WorkerRecord(
        registration=WorkerRegistration(worker_id=wid, url=f"http://{wid}.invalid", kind="cpu",
                                        models=("m",), slots=1, labels={"pop": pop}),
        load=WorkerLoad(tokens_per_s=100.0 if pop == "fra" else 10.0), lease_expires_in_s=3.0)


def scheduler(rtt_ms: float) -> Scheduler:
    policy = Policy.model_validate({"topology": {
        "pops": [{"name": "ams", "region": "eu"}, {"name": "fra", "region": "eu"}],
        "rtt_ms": {"ams": {"fra": rtt_ms}}}})
    directory = LatestValue(RegistrySnapshot(version=1, workers=(
        record("ams-1", "ams"), record("fra-1", "fra"))), 1)
    return Scheduler(policy, directory, pop="ams")


def ticket(n: int) -> Ticket:
    now = time.monotonic()
    return Ticket(request_id=f"r{n}", tenant="local", model="m", arrival=now, deadline=now + 30,
                  estimated_tokens=10, route=RouteRequest(10), hedgeable=True)


@pytest.mark.anyio
async def test_gateway_serves_in_its_pop_and_spills_only_when_waiting_costs_more() -> None:
    near = scheduler(rtt_ms=20)  # a slot takes ~1 s (the first estimate): spill
    first, second = ticket(1), ticket(2)
    assert isinstance(near.submit(first, time.monotonic()), Assigned)
    assert isinstance(near.submit(second, time.monotonic()), Assigned)
    assert first.assignment.worker is not None and second.assignment.worker is not None
    assert first.assignment.worker.registration.worker_id == "ams-1"
    assert second.assignment.worker.registration.worker_id == "fra-1"

    far = scheduler(rtt_ms=5000)  # the WAN costs more than waiting: hold for ams-1
    first, second = ticket(1), ticket(2)
    assert isinstance(far.submit(first, time.monotonic()), Assigned)
    assert far.submit(second, time.monotonic()) is QUEUED
    assert first.assignment.worker is not None
    assert first.assignment.worker.registration.worker_id == "ams-1"
    assert not second.assignment.settled


def test_the_class_tier_stays_ahead_of_locality() -> None:
    accurate_far = Candidate("fra-q8", 2, 0, 0, tier="accurate", pop="fra")
    fast_near = Candidate("ams-q4", 2, 0, 0, tier="fast", pop="ams")
    accurate_near = Candidate("ams-q8", 2, 0, 0, tier="accurate", pop="ams")
    everyone = [accurate_far, fast_near, accurate_near]
    ranked = score_workers(everyone, RouteRequest(50, tier="accurate"), {})
    ctx = RouteContext({}, tier="accurate")
    assert ids(AMS.plan(ranked, everyone, ctx)) == ["ams-q8", "fra-q8", "ams-q4"]
    # The local accurate worker is busy: the request may wait for it, not for the fast one.
    inflight = {"ams-q8": 2}
    ranked = score_workers(everyone, RouteRequest(50, tier="accurate"), inflight)
    ctx = RouteContext(inflight, tier="accurate", mean_service_s=0.01, may_hold=True)
    assert AMS.plan(ranked, everyone, ctx) == []
