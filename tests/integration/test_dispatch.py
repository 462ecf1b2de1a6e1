"""Tail control through the real scheduler and dispatcher, against in-memory workers.

A real ``Scheduler`` over a registry of fake workers, its clock task under a
real ``Supervisor``; a real ``Dispatcher`` talks to them through ``WorkerClient`` with a
``tests.support.worker_mock.MockTransport`` twin (``tests.support.fake_workers``) that streams
OpenAI chunks with controlled delays and failures and records what reached
each worker. ``Rig.serve`` does what the gateway app does for a streaming
request (submit, first token, relay, report, ticket done), so each test
asserts what a client or an operator would notice: who answered, when, what
the SSE stream said, which worker requests were made or cut short, and the
scheduler's own statistics. No sockets, no model; small real delays.
"""

from __future__ import annotations

import asyncio

import copy
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
import pytest
import yaml
from anyio.abc import TaskGroup

from gateway.corridor.attempt import Attempt, UpstreamCall
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.generation import Generation
from gateway.corridor.relay import RelayOutcome, follow_log
from gateway.corridor.stream_log import StreamLog
from gateway.corridor.scheduler import Scheduler
from gateway.corridor.scheduling import SchedulerClock, SchedulerDoor
from gateway.corridor.tickets import Ticket
from gateway.upstream.client import WorkerClient
from hedgerow.actors import ActorState, SupervisedChild, Supervisor
from hedgerow.asgi import Message, Request
from hedgerow.sse import SseEvent
from hedgerow.errors import NoHealthyWorker, UpstreamModelNotFound, UpstreamRejected
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerRecord
from policies.admission import Refused
from policies.schema import Policy, parse_policy
from policies.scoring import RouteRequest
from tests.support.fake_workers import Behaviour, FakeWorkers, record

pytestmark = pytest.mark.anyio

MODEL = "m"
TEXT = "Hello, world"

BASE_POLICY: dict[str, Any] = {
    "anonymous_tenant": "t",
    "classes": [
        {"name": "interactive", "ttft_slo_ms": 1000, "deadline_ms": 10000, "hedge": True},
        {"name": "batch", "ttft_slo_ms": 30000, "deadline_ms": 120000, "hedge": False},
    ],
    "tenants": [{"name": "t", "class": "interactive"}],
    "models": [{"name": MODEL}],
    "timeouts": {"ttft_ms": 5000},
    "hedging": {"enabled": True, "floor_ms": 150, "ceiling_ms": 150,
                "budget_ratio": 1.0, "budget_burst": 10},
    "breaker": {"failures_to_open": 3, "open_for_ms": 2000},
}


def make_policy(**sections: Any) -> Policy:
    """The base policy with whole sections merged in (dicts) or replaced (lists)."""
    doc = copy.deepcopy(BASE_POLICY)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key].update(value)
        else:
            doc[key] = value
    return parse_policy(yaml.safe_dump(doc), "test policy")


def tenant_limits(**limits: Any) -> list[dict[str, Any]]:
    return [{"name": "t", "class": "interactive", "limits": limits}]


# -- the client side ----------------------------------------------------------


@dataclass
class ClientSink:
    """The ASGI ``send`` side of one client connection, recorded with times."""

    sent: list[tuple[float, Message]] = field(default_factory=list)

    async def send(self, message: Message) -> None:
        self.sent.append((anyio.current_time(), message))

    async def receive(self) -> Message:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    def request(self) -> Request:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        return Request(scope, self.receive, self.send)

    def data(self) -> list[str]:
        body = b"".join(m.get("body", b"") for _, m in self.sent
                        if m["type"] == "http.response.body")
        return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]

    def text(self) -> str:
        chunks = [orjson.loads(d) for d in self.data() if d != "[DONE]"]
        return "".join((c["choices"][0]["delta"].get("content") or "")
                       for c in chunks if c.get("choices"))

    def response_closed(self) -> bool:
        return bool(self.sent) and not self.sent[-1][1].get("more_body", False)


@dataclass
class Served:
    """What one request came to, as its client would see it."""

    ticket: Ticket
    started: float
    ended: float = 0.0
    refused: Refused | None = None
    error: BaseException | None = None
    worker_id: str | None = None
    hedged: bool = False
    outcome: RelayOutcome | None = None
    sink: ClientSink = field(default_factory=ClientSink)

    @property
    def elapsed(self) -> float:
        return self.ended - self.started


# -- the rig --------------------------------------------------------------------


class ClockTaskClock:
    """The scheduler clock task's time; ``crash_next`` makes its next reading raise,
    as a bug in a tick would."""

    def __init__(self) -> None:
        self.crash = False

    def crash_next(self) -> None:
        self.crash = True

    def __call__(self) -> float:
        if self.crash:
            self.crash = False
            raise RuntimeError("injected: the scheduler's clock task crashes")
        return time.monotonic()


@dataclass
class Rig:
    policy: Policy
    scheduler: SchedulerDoor
    dispatcher: Dispatcher
    workers: FakeWorkers
    directory: LatestValue[RegistrySnapshot]
    clock: ClockTaskClock
    clock_task: SupervisedChild
    _ids: Any = field(default_factory=itertools.count)

    def ticket(self, klass: str = "interactive", *, deadline_s: float | None = None) -> Ticket:
        """A ticket as the gateway app builds one for tenant ``t``."""
        now = time.monotonic()
        priority = self.policy.priority_class(klass)
        deadline = deadline_s if deadline_s is not None else priority.deadline_ms / 1000
        due = min(priority.ttft_slo_ms / 1000, deadline)
        route = RouteRequest(prompt_tokens=8,
                             prefer_gpu_above_tokens=self.policy.routing.prefer_gpu_above_tokens,
                             allow_cpu_fallback=self.policy.routing.allow_cpu_fallback)
        return Ticket(request_id=f"{klass}-{next(self._ids)}", tenant="t", model=MODEL,
                      arrival=now, due=now + due, deadline=now + deadline,
                      estimated_tokens=24, route=route, hedgeable=priority.hedge)

    @staticmethod
    def call(ticket: Ticket) -> UpstreamCall:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about foxes."}],
                "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
        return UpstreamCall(ticket.request_id, "/v1/chat/completions", orjson.dumps(body), MODEL)

    async def stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    async def admitted(self, ticket: Ticket) -> bool:
        """Submitted as the gateway does: True when assigned or queued, not refused."""
        return not isinstance(await self.scheduler.submit(ticket), Refused)

    def withdraw(self, ticket: Ticket) -> None:
        """What the dispatcher does when the client leaves while the ticket waits."""
        self.scheduler.scheduler.withdraw(ticket, time.monotonic())

    async def serve(self, ticket: Ticket) -> Served:
        """What ``GatewayApp`` does for one streaming request: a generation
        writes the stream's log, the client follows it."""
        served = Served(ticket, anyio.current_time())
        stream = StreamLog(ticket.request_id, "t", 1 << 20, include_usage=True)
        generation = Generation(self.scheduler, self.dispatcher, stream, ticket,
                                self.call(ticket))
        request = served.sink.request()

        async def generate() -> None:
            served.outcome = await generation.run()

        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            await stream.wait_open()
            if stream.started:
                served.worker_id, served.hedged = stream.worker_id, stream.hedged
                await request.send({"type": "http.response.start", "status": 200,
                                    "headers": []})
                await follow_log(request, stream, after=0, include_usage=True,
                                 heartbeat_s=60, stall_s=60)
        served.refused = generation.refused
        if stream.refusal is not None and served.refused is None:
            served.error = stream.refusal.error
        served.ended = anyio.current_time()
        return served

    async def serve_into(self, results: dict[str, Served], ticket: Ticket) -> None:
        results[ticket.request_id] = await self.serve(ticket)


@asynccontextmanager
async def running(policy: Policy, behaviours: dict[str, Behaviour],
                  records: list[WorkerRecord] | None = None) -> AsyncIterator[Rig]:
    """Scheduler + dispatcher over fake workers (one cpu worker per behaviour, 4 slots)."""
    workers = FakeWorkers(behaviours)
    records = records or [record(w, model=MODEL) for w in behaviours]
    directory = LatestValue(RegistrySnapshot(version=1, workers=tuple(records)), 1)
    client = WorkerClient(policy.timeouts, transport=workers.transport())
    try:
        async with Supervisor() as supervisor:
            scheduler = Scheduler(policy, directory)
            clock = ClockTaskClock()
            clock_task = supervisor.run_service("scheduler-clock",
                                                SchedulerClock(scheduler, clock=clock).run)
            yield Rig(policy, SchedulerDoor(scheduler), Dispatcher(scheduler, client, policy),
                      workers, directory, clock, clock_task)
    finally:
        await client.aclose()


async def wait_until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


async def eventually_idle(rig: Rig) -> dict[str, Any]:
    """Stats once nothing is in flight any more (the attempts ending in other tasks)."""
    with anyio.fail_after(2.0):
        while True:
            stats = await rig.stats()
            if not stats["inflight"]:
                return stats
            await anyio.sleep(0.01)


async def queued_becomes(rig: Rig, count: int) -> None:
    with anyio.fail_after(2.0):
        while (await rig.stats())["queued"].get(MODEL) != count:
            await anyio.sleep(0.005)


def assert_served_fully(served: Served) -> None:
    assert served.refused is None and served.error is None, (served.refused, served.error)
    assert served.outcome is not None and served.outcome.complete and not served.outcome.failed
    assert served.sink.text() == TEXT
    assert served.sink.data()[-1] == "[DONE]"
    assert served.sink.response_closed()


# -- 1. hedging fires at the pool's delay; the loser is cancelled ---------------


@pytest.mark.parametrize("slow_phase", ["before_headers", "after_headers"])
async def test_slow_first_token_is_hedged_after_the_delay_and_the_loser_is_cut_off(
    slow_phase: str,
) -> None:
    # A real worker starts its response at its first token; a proxy in between
    # may start it early. Either way the straggler must be hedged and cut off.
    slow = (Behaviour(headers_after_s=3.0) if slow_phase == "before_headers"
            else Behaviour(first_token_after_s=3.0))
    async with running(make_policy(), {"a": slow, "b": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket())
        assert_served_fully(served)
        assert served.worker_id == "b" and served.hedged
        [primary], [hedge] = rig.workers.calls_to("a"), rig.workers.calls_to("b")
        assert 0.14 <= hedge.arrived - primary.arrived <= 0.30
        assert served.elapsed < 0.6  # not the straggler's 3 s
        await wait_until(lambda: primary.hung_up)
        assert not primary.completed and hedge.completed and not hedge.hung_up
        stats = await eventually_idle(rig)
        assert stats["counters"]["hedges_started"] == 1


async def test_a_primary_that_answers_after_the_hedge_started_wins_and_cuts_the_hedge_off(
) -> None:
    # The primary runs in the caller's task; the hedge, started by a timer, in
    # its own. The primary answering first must cancel the hedge's task.
    policy = make_policy(hedging={"floor_ms": 50, "ceiling_ms": 50})
    behaviours = {"a": Behaviour(headers_after_s=0.25), "b": Behaviour(headers_after_s=3.0)}
    async with running(policy, behaviours) as rig:
        served = await rig.serve(rig.ticket())
        assert_served_fully(served)
        assert served.worker_id == "a" and not served.hedged
        [hedge] = rig.workers.calls_to("b")
        await wait_until(lambda: hedge.hung_up)
        assert not hedge.completed
        stats = await eventually_idle(rig)
        assert stats["counters"]["hedges_started"] == 1


async def test_a_primary_that_fails_while_the_hedge_runs_leaves_the_answer_to_the_hedge(
) -> None:
    # No retry while the hedge may still answer: the third worker is never asked.
    policy = make_policy(hedging={"floor_ms": 50, "ceiling_ms": 50},
                         retries={"before_first_token": 2})
    behaviours = {"a": Behaviour(status=503, headers_after_s=0.15),
                  "b": Behaviour(headers_after_s=0.3), "c": Behaviour()}
    async with running(policy, behaviours) as rig:
        # The scheduler spreads requests: ask until the primary went to a and
        # the hedge to b (c, which answers at once, serves the others).
        for _ in range(12):
            ticket = rig.ticket()
            served = await rig.serve(ticket)
            if [c.worker_id for c in rig.workers.calls[-2:]] == ["a", "b"]:
                break
        else:
            raise AssertionError(f"never placed on a, then hedged on b: {rig.workers.calls}")
        assert_served_fully(served)
        assert served.worker_id == "b" and served.hedged
        await eventually_idle(rig)


# anyio made the hedge's coroutine before it found it could not spawn it.
@pytest.mark.filterwarnings("ignore:coroutine 'Dispatcher._hedge_attempt' was never awaited")
def test_a_hedge_that_cannot_start_gives_its_slot_back_and_the_request_goes_on() -> None:
    # The hedge starts from a timer callback. Under plain asyncio (no anyio.run:
    # no sniffio context in the callback) anyio cannot spawn it there; the
    # worker slot taken for it must come back, and the primary's failure must
    # still be retried instead of waiting for a hedge that never ran.
    async def main() -> tuple[Served, dict[str, Any], list[str]]:
        policy = make_policy(hedging={"floor_ms": 50, "ceiling_ms": 50},
                             retries={"before_first_token": 2})
        behaviours = {"a": Behaviour(status=503, headers_after_s=0.15), "b": Behaviour()}
        async with running(policy, behaviours) as rig:
            with anyio.fail_after(3):
                served = await rig.serve(rig.ticket())
            return served, await eventually_idle(rig), [c.worker_id for c in rig.workers.calls]

    served, stats, calls = asyncio.run(main())
    assert_served_fully(served)
    assert served.worker_id == "b" and calls == ["a", "b"]  # a's failure retried on b
    assert stats["inflight"] == {}


async def test_hedge_delay_follows_the_pools_live_ttft_quantile() -> None:
    policy = make_policy(hedging={"floor_ms": 20, "ceiling_ms": 2000, "min_samples": 5,
                                  "quantile": 0.95})
    usual = Behaviour(first_token_after_s=0.08)
    async with running(policy, {"a": usual, "b": Behaviour()}) as rig:
        for _ in range(5):  # below min_samples the ceiling (2 s) applies: no hedge
            assert_served_fully(await rig.serve(rig.ticket()))
        assert rig.workers.calls_to("b") == []
        rig.workers.behaviours["a"] = Behaviour(first_token_after_s=3.0)
        served = await rig.serve(rig.ticket())
        assert served.worker_id == "b" and served.hedged
        gap = rig.workers.calls_to("b")[0].arrived - rig.workers.calls_to("a")[-1].arrived
        assert 0.075 <= gap <= 0.25  # the pool's p95 TTFT (~80 ms), not the 2 s ceiling
        await eventually_idle(rig)


@pytest.mark.parametrize("turns_apart", range(6))
async def test_near_simultaneous_first_tokens_leave_no_stream_open_and_no_slot_held(
    turns_apart: int,
) -> None:
    # Primary and hedge get their first tokens a few event-loop turns apart, so
    # the loser is somewhere between its first token and handing it over when
    # the winner is chosen: wherever it is, its stream must be closed and its
    # slot released.
    release_a, release_b = anyio.Event(), anyio.Event()
    policy = make_policy(hedging={"floor_ms": 30, "ceiling_ms": 30})
    behaviours = {"a": Behaviour(hold=release_a), "b": Behaviour(hold=release_b)}
    async with running(policy, behaviours) as rig:
        results: dict[str, Served] = {}
        async with anyio.create_task_group() as tg:
            ticket = rig.ticket()
            tg.start_soon(rig.serve_into, results, ticket)
            await wait_until(lambda: len(rig.workers.calls) == 2)
            await anyio.sleep(0.01)
            release_a.set()
            for _ in range(turns_apart):
                await anyio.sleep(0)
            release_b.set()
        assert_served_fully(results[ticket.request_id])
        await eventually_idle(rig)
        winner = results[ticket.request_id].worker_id
        [loser] = [c for c in rig.workers.calls if c.worker_id != winner]
        assert loser.hung_up and not loser.completed


@pytest.mark.parametrize("turns_apart", range(6))
async def test_a_race_whose_attempts_fail_to_close_still_frees_every_slot(
    turns_apart: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As above, but closing any attempt (the winner's, a loser's) raises after it closed.
    aclose = Attempt.aclose

    async def raising_aclose(self: Attempt) -> None:
        await aclose(self)
        raise OSError("injected: the connection broke as it was closed")

    monkeypatch.setattr(Attempt, "aclose", raising_aclose)
    release_a, release_b = anyio.Event(), anyio.Event()
    policy = make_policy(hedging={"floor_ms": 30, "ceiling_ms": 30})
    behaviours = {"a": Behaviour(hold=release_a), "b": Behaviour(hold=release_b)}
    async with running(policy, behaviours) as rig:
        results: dict[str, Served] = {}
        async with anyio.create_task_group() as tg:
            ticket = rig.ticket()
            tg.start_soon(rig.serve_into, results, ticket)
            await wait_until(lambda: len(rig.workers.calls) == 2)
            await anyio.sleep(0.01)
            release_a.set()
            for _ in range(turns_apart):
                await anyio.sleep(0)
            release_b.set()
        assert_served_fully(results[ticket.request_id])
        await eventually_idle(rig)
        assert ticket.finished


async def test_client_leaving_during_a_hedged_race_cuts_off_both_workers() -> None:
    policy = make_policy(hedging={"floor_ms": 50, "ceiling_ms": 50})
    slow = {"a": Behaviour(first_token_after_s=3.0), "b": Behaviour(first_token_after_s=3.0)}
    async with running(policy, slow) as rig:
        ticket = rig.ticket()
        assert await rig.admitted(ticket)
        with anyio.move_on_after(0.2):
            await rig.dispatcher.first_token(ticket, rig.call(ticket))
        assert len(rig.workers.calls) == 2
        assert all(c.hung_up for c in rig.workers.calls)
        await eventually_idle(rig)


@pytest.mark.parametrize("hedged", [False, True])
@pytest.mark.parametrize("turns_later", range(8))
async def test_client_leaving_as_the_first_token_arrives_leaks_nothing(
    turns_later: int, hedged: bool,
) -> None:
    # The client leaves a few event-loop turns after the worker's first token:
    # before, while or after the dispatcher picks the winner (and, hedged, while
    # it is still cutting off the loser, which never answers).
    release = anyio.Event()
    policy = make_policy(hedging={"enabled": hedged, "floor_ms": 30, "ceiling_ms": 30})
    never = Behaviour(hold=anyio.Event())
    async with running(policy, {"a": Behaviour(hold=release), "b": never}) as rig:
        ticket = rig.ticket()
        assert await rig.admitted(ticket)
        got: list[Attempt] = []
        async with anyio.create_task_group() as tg:
            client = anyio.CancelScope()

            async def wait_for_first_token() -> None:
                with client:
                    got.append(await rig.dispatcher.first_token(ticket, rig.call(ticket)))

            tg.start_soon(wait_for_first_token)
            await wait_until(lambda: len(rig.workers.calls) == (2 if hedged else 1))
            await anyio.sleep(0.01)
            release.set()
            for _ in range(turns_later):
                await anyio.sleep(0)
            client.cancel()
        for attempt in got:  # it got its attempt before leaving: the app closes it
            await attempt.aclose()
            rig.dispatcher.report(attempt.worker_id, "abandoned")
        await eventually_idle(rig)
        assert all(call.hung_up and not call.completed for call in rig.workers.calls)


# -- 2, 3. the hedge budget and non-hedgeable requests ---------------------------


async def test_no_hedge_without_budget_the_primary_answers() -> None:
    policy = make_policy(hedging={"floor_ms": 50, "ceiling_ms": 50, "budget_ratio": 0.0})
    async with running(policy, {"a": Behaviour(first_token_after_s=0.3),
                                "b": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket())
        assert_served_fully(served)
        assert served.worker_id == "a" and not served.hedged
        assert served.elapsed >= 0.3
        assert rig.workers.calls_to("b") == []
        stats = await eventually_idle(rig)
        assert stats["counters"]["hedge_budget_exhausted"] == 1
        assert stats["hedge_budget"]["spent"] == 0


@pytest.mark.parametrize(("ratio", "requests"), [(0.25, 8), (0.1, 10)])
async def test_hedges_stay_within_ratio_of_requests(ratio: float, requests: int) -> None:
    policy = make_policy(hedging={"floor_ms": 20, "ceiling_ms": 20, "budget_ratio": ratio,
                                  "budget_burst": 1})
    async with running(policy, {"a": Behaviour(first_token_after_s=0.06),
                                "b": Behaviour()}) as rig:
        results = [await rig.serve(rig.ticket()) for _ in range(requests)]
        for served in results:
            assert_served_fully(served)
        hedges = len(rig.workers.calls_to("b"))
        assert hedges == sum(s.hedged for s in results)
        # The budget starts empty and earns `ratio` per request (ten 0.1s make a
        # whole hedge, float rounding notwithstanding): every 1/ratio-th is hedged.
        assert hedges == round(ratio * requests)
        assert results[-1].hedged
        stats = await eventually_idle(rig)
        assert stats["hedge_budget"]["spent"] == hedges
        assert stats["hedge_budget"]["requests"] == requests


@pytest.mark.parametrize("why", ["class_not_hedgeable", "hedging_disabled"])
async def test_request_that_must_not_be_hedged_waits_for_its_worker(why: str) -> None:
    hedging = {"floor_ms": 30, "ceiling_ms": 30, "enabled": why != "hedging_disabled"}
    klass = "batch" if why == "class_not_hedgeable" else "interactive"
    async with running(make_policy(hedging=hedging),
                       {"a": Behaviour(first_token_after_s=0.25), "b": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket(klass))
        assert_served_fully(served)
        assert served.worker_id == "a" and not served.hedged
        assert rig.workers.calls_to("b") == []
        stats = await eventually_idle(rig)
        assert "hedges_started" not in stats["counters"]
        assert "hedge_budget_exhausted" not in stats["counters"]


# -- 4, 5. failures before the first token: retried, or passed through ------------


@pytest.mark.parametrize("failure", ["connection_refused", "status_500", "ttft_timeout"])
async def test_failure_before_first_token_is_retried_invisibly(failure: str) -> None:
    broken = {"connection_refused": Behaviour(refuse_connection=True),
              "status_500": Behaviour(status=500),
              "ttft_timeout": Behaviour(headers_after_s=3.0)}[failure]
    policy = make_policy(hedging={"enabled": False}, timeouts={"ttft_ms": 150},
                         breaker={"failures_to_open": 1})
    async with running(policy, {"a": broken, "b": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket())
        assert_served_fully(served)
        assert served.worker_id == "b" and not served.hedged
        assert not any('"error"' in d for d in served.sink.data())
        [first] = rig.workers.calls_to("a")
        if failure == "ttft_timeout":
            assert first.hung_up and 0.14 <= served.elapsed <= 0.5
        stats = await eventually_idle(rig)
        assert stats["counters"]["retries"] == 1
        # failures_to_open is 1: the one failure the worker caused opened its breaker.
        assert stats["counters"]["breaker_to_open"] == 1
        assert stats["breakers"] == {"a": "open", "b": "closed"}


@pytest.mark.parametrize("hedge_refused", [False, True])
async def test_retries_stop_at_the_policy_limit(hedge_refused: bool) -> None:
    # A hedge that was due but refused by the budget does not buy an extra retry.
    failing = Behaviour(headers_after_s=0.1 if hedge_refused else 0.0, status=500)
    hedging = ({"floor_ms": 30, "ceiling_ms": 30, "budget_ratio": 0.0} if hedge_refused
               else {"enabled": False})
    policy = make_policy(hedging=hedging, retries={"before_first_token": 1})
    behaviours = {"a": failing, "b": Behaviour(status=500), "c": Behaviour()}
    async with running(policy, behaviours) as rig:
        served = await rig.serve(rig.ticket())
        assert isinstance(served.error, NoHealthyWorker)
        assert served.error.status == 503 and served.sink.sent == []
        assert [c.worker_id for c in rig.workers.calls] == ["a", "b"]
        stats = await eventually_idle(rig)
        assert stats["counters"]["retries"] == 1


def failing_and_busy(hold: anyio.Event, **policy: Any) -> tuple[
        Policy, dict[str, Behaviour], list[WorkerRecord]]:
    """One slot each: ``a`` streams while ``hold`` is unset, ``b`` fails before any token."""
    return (make_policy(hedging={"enabled": False}, **policy),
            {"a": Behaviour(hold=hold), "b": Behaviour(status=500)},
            [record("a", model=MODEL, slots=1), record("b", model=MODEL, slots=1)])


async def busy_then_retried(rig: Rig, tg: TaskGroup, results: dict[str, Served],
                            retried: Ticket) -> None:
    """A stream keeps ``a`` busy; ``retried`` fails on ``b`` and waits in the queue."""
    tg.start_soon(rig.serve_into, results, rig.ticket())
    await wait_until(lambda: len(rig.workers.calls_to("a")) == 1)
    tg.start_soon(rig.serve_into, results, retried)
    await wait_until(lambda: len(rig.workers.calls_to("b")) == 1)
    await queued_becomes(rig, 1)


async def test_retry_with_every_other_worker_busy_waits_and_is_served_when_one_frees() -> None:
    hold = anyio.Event()
    async with running(*failing_and_busy(hold)) as rig:
        results: dict[str, Served] = {}
        retried = rig.ticket()
        async with anyio.create_task_group() as tg:
            await busy_then_retried(rig, tg, results, retried)
            await anyio.sleep(0.2)
            assert retried.request_id not in results  # waiting, not refused with a 503
            hold.set()  # the busy stream ends: a is free
        served = results[retried.request_id]
        assert_served_fully(served)
        assert served.worker_id == "a" and served.elapsed >= 0.2
        assert [c.worker_id for c in rig.workers.calls_for(retried.request_id)] == ["b", "a"]
        stats = await eventually_idle(rig)
        assert stats["counters"]["retries"] == 1 and stats["counters"]["retries_queued"] == 1
        assert stats["queued"][MODEL] == 0


async def test_retry_still_queued_at_its_deadline_gets_the_queues_503() -> None:
    hold = anyio.Event()
    async with running(*failing_and_busy(hold, scheduling={"slo_admission": False})) as rig:
        results: dict[str, Served] = {}
        retried = rig.ticket(deadline_s=0.3)
        async with anyio.create_task_group() as tg:
            await busy_then_retried(rig, tg, results, retried)
            await wait_until(lambda: retried.request_id in results)
            hold.set()
        served = results[retried.request_id]
        assert isinstance(served.error, NoHealthyWorker) and served.sink.sent == []
        assert (served.error.status, served.error.code) == (503, "deadline_exceeded")
        assert 0.25 <= served.elapsed <= 0.6
        assert [c.worker_id for c in rig.workers.calls_for(retried.request_id)] == ["b"]
        stats = await eventually_idle(rig)
        assert stats["counters"]["shed_deadline"] == 1 and stats["queued"][MODEL] == 0


async def test_client_gone_while_its_retry_is_queued_withdraws_it() -> None:
    hold = anyio.Event()
    async with running(*failing_and_busy(hold,
                                         tenants=tenant_limits(max_concurrency=2))) as rig:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.serve, rig.ticket())
            await wait_until(lambda: len(rig.workers.calls_to("a")) == 1)
            gone = rig.ticket()
            assert await rig.admitted(gone)
            with anyio.move_on_after(0.2):  # fails on b, queued for a, then the client leaves
                await rig.dispatcher.first_token(gone, rig.call(gone))
            assert (await rig.stats())["queued"][MODEL] == 0
            # No ticket_done was called, yet the tenant's slot is free again.
            nxt = rig.ticket()
            assert await rig.admitted(nxt)
            rig.withdraw(nxt)
            hold.set()
        await eventually_idle(rig)
        assert [c.worker_id for c in rig.workers.calls_for(gone.request_id)] == ["b"]


async def test_worker_400_is_a_generic_400_not_retried() -> None:
    policy = make_policy(breaker={"failures_to_open": 1})
    async with running(policy, {"a": Behaviour(status=400), "b": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket())
        assert isinstance(served.error, UpstreamRejected)
        assert served.error.status == 400
        assert "max_tokens is too large" in served.error.detail  # logged, not sent
        assert "max_tokens is too large" not in served.error.message
        assert rig.workers.calls_to("b") == []
        stats = await eventually_idle(rig)
        assert "retries" not in stats["counters"]
        assert "breaker_to_open" not in stats["counters"]  # the client's fault, not the worker's
        assert stats["breakers"]["a"] == "closed"


@pytest.mark.parametrize("hedging", [False, True], ids=["one_at_a_time", "raced"])
async def test_worker_404_is_a_generic_404_not_retried_and_its_breaker_is_told(
    hedging: bool,
) -> None:
    policy = make_policy(breaker={"failures_to_open": 1},
                         hedging={"enabled": hedging, "floor_ms": 500, "ceiling_ms": 500})
    async with running(policy, {"a": Behaviour(status=404), "b": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket())
        assert isinstance(served.error, UpstreamModelNotFound)
        assert (served.error.status, served.error.code) == (404, "model_not_found")
        assert "max_tokens is too large" in served.error.detail  # logged, not sent
        assert "max_tokens is too large" not in served.error.message
        assert len(rig.workers.calls) == 1  # one upstream call, not one per worker
        stats = await eventually_idle(rig)
        assert "retries" not in stats["counters"]
        # The model was routed to "a" because it registered it: a worker that
        # answers 404 for it is the one at fault, and gets no more requests.
        assert stats["breakers"]["a"] == "open"
        assert_served_fully(await rig.serve(rig.ticket()))
        assert [c.worker_id for c in rig.workers.calls] == ["a", "b"]


# -- 6. failure after the first token ---------------------------------------------


@pytest.mark.parametrize(("breakage", "code"), [
    (Behaviour(break_after_tokens=1), "upstream_unreachable"),
    (Behaviour(end_after_tokens=2), "upstream_truncated"),
    (Behaviour(garbage_after_tokens=1), "upstream_malformed"),
])
async def test_failure_after_first_token_ends_the_stream_with_an_error_event(
    breakage: Behaviour, code: str,
) -> None:
    async with running(make_policy(), {"a": breakage, "b": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket())
        assert served.error is None and served.worker_id == "a"
        data = served.sink.data()
        assert "[DONE]" not in data
        assert TEXT.startswith(served.sink.text()) and served.sink.text()  # a token got out
        error = orjson.loads(data[-1])["error"]
        assert error["code"] == code and error["type"] == "upstream_error"
        assert served.sink.response_closed()
        assert served.outcome is not None and served.outcome.failed
        assert rig.workers.calls_to("b") == []  # too late to retry: the client saw tokens
        await eventually_idle(rig)


@pytest.mark.parametrize(("garbage", "complete"), [(None, True), (b"data: not json\n\n", False)])
async def test_non_streaming_client_gets_the_whole_answer_or_an_upstream_error(
    garbage: bytes | None, complete: bool,
) -> None:
    worker = (Behaviour() if garbage is None
              else Behaviour(garbage_after_tokens=1, garbage=garbage))
    async with running(make_policy(), {"a": worker}) as rig:
        ticket = rig.ticket()
        stream = StreamLog(ticket.request_id, "t", 1 << 20)
        outcome = await Generation(rig.scheduler, rig.dispatcher, stream, ticket,
                                   rig.call(ticket), keep_text=True).run()
        if complete:
            assert outcome.complete and not outcome.failed
            assert outcome.fold.first().text == TEXT and outcome.completion_tokens == 3
        else:
            # Never relayed as it came: the stream ends with an error event instead.
            assert outcome.failed and outcome.error_code == "upstream_malformed"
            last = stream.events_after(0)[-1]
            assert last.kind == "error" and b"not json" not in last.payload
        await eventually_idle(rig)


# -- 7. circuit breaker -----------------------------------------------------------


async def test_breaker_opens_moves_traffic_then_one_probe_closes_it() -> None:
    policy = make_policy(hedging={"enabled": False},
                         breaker={"failures_to_open": 2, "open_for_ms": 300})
    async with running(policy, {"a": Behaviour(status=500), "b": Behaviour()}) as rig:
        for _ in range(2):  # a is preferred (ties go by id) and fails; b answers instead
            served = await rig.serve(rig.ticket())
            assert_served_fully(served)
            assert served.worker_id == "b"
        assert len(rig.workers.calls_to("a")) == 2
        assert (await rig.stats())["breakers"]["a"] == "open"
        served = await rig.serve(rig.ticket())  # open: a is not even tried
        assert served.worker_id == "b"
        assert len(rig.workers.calls_to("a")) == 2

        rig.workers.behaviours["a"] = Behaviour(first_token_after_s=0.1)
        await anyio.sleep(0.35)  # open_for_ms has passed: half-open, one probe allowed
        results: dict[str, Served] = {}
        async with anyio.create_task_group() as tg:
            probe, other = rig.ticket(), rig.ticket()
            tg.start_soon(rig.serve_into, results, probe)
            await wait_until(lambda: len(rig.workers.calls_to("a")) == 3)
            tg.start_soon(rig.serve_into, results, other)
        assert results[probe.request_id].worker_id == "a"  # the probe
        assert results[other.request_id].worker_id == "b"  # not a second probe
        stats = await eventually_idle(rig)
        assert stats["breakers"]["a"] == "closed"
        assert stats["counters"]["breaker_to_open"] == 1
        assert stats["counters"]["breaker_to_half_open"] == 1
        assert stats["counters"]["breaker_to_closed"] == 1
        assert (await rig.serve(rig.ticket())).worker_id == "a"  # closed again


# -- 8. EDF order, shedding, admission refusals ------------------------------------


def one_slot(policy: Policy, hold: anyio.Event) -> tuple[Policy, dict[str, Behaviour],
                                                          list[WorkerRecord]]:
    return policy, {"a": Behaviour(hold=hold)}, [record("a", model=MODEL, slots=1)]


async def test_queued_tickets_get_the_free_slot_earliest_deadline_first() -> None:
    hold = anyio.Event()
    async with running(*one_slot(make_policy(), hold)) as rig:
        results: dict[str, Served] = {}
        async with anyio.create_task_group() as tg:
            busy, batch, interactive = rig.ticket(), rig.ticket("batch"), rig.ticket()
            tg.start_soon(rig.serve_into, results, busy)
            await wait_until(lambda: len(rig.workers.calls) == 1)
            rig.workers.behaviours["a"] = Behaviour()
            tg.start_soon(rig.serve_into, results, batch)  # arrives first...
            await queued_becomes(rig, 1)
            tg.start_soon(rig.serve_into, results, interactive)  # ...but is due sooner
            await queued_becomes(rig, 2)
            hold.set()
        order = [c.request_id for c in rig.workers.calls]
        assert order == [busy.request_id, interactive.request_id, batch.request_id]
        for served in results.values():
            assert_served_fully(served)
        await eventually_idle(rig)


async def test_ticket_still_queued_at_its_deadline_is_shed_not_run() -> None:
    # Admission's own deadline check is off, so the queue has to shed it.
    policy = make_policy(scheduling={"slo_admission": False},
                         tenants=tenant_limits(max_concurrency=2))
    hold = anyio.Event()
    async with running(*one_slot(policy, hold)) as rig:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.serve, rig.ticket())
            await wait_until(lambda: len(rig.workers.calls) == 1)
            late = rig.ticket(deadline_s=0.15)
            shed_task = anyio.Event()
            results: dict[str, Served] = {}

            async def serve_late() -> None:
                await rig.serve_into(results, late)
                shed_task.set()

            tg.start_soon(serve_late)
            await queued_becomes(rig, 1)
            refused = await rig.scheduler.submit(rig.ticket())
            assert isinstance(refused, Refused)
            assert (refused.status, refused.reason) == (429, "concurrency")
            with anyio.fail_after(1):
                await shed_task.wait()
            served = results[late.request_id]
            assert isinstance(served.error, NoHealthyWorker)
            assert served.error.code == "deadline_exceeded" and served.error.status == 503
            assert 0.12 <= served.elapsed <= 0.4
            assert rig.workers.calls_for(late.request_id) == []
            # Its hold on the tenant's concurrency went with it.
            after = rig.ticket()
            assert await rig.admitted(after)
            rig.withdraw(after)
            hold.set()
        stats = await eventually_idle(rig)
        assert stats["counters"]["shed_deadline"] == 1
        assert stats["queued"][MODEL] == 0


async def test_a_crash_of_the_scheduler_clock_task_loses_no_queued_request() -> None:
    # Before, the scheduler was an actor: a crash lost its queues (first the queued
    # requests waited forever, then each got a 503 scheduler_restarted). Now the
    # queues live in the scheduler object, and the clock task only borrows it.
    hold = anyio.Event()
    policy, behaviours, records = one_slot(make_policy(hedging={"enabled": False}), hold)
    behaviours["b"] = Behaviour()
    async with running(policy, behaviours, records) as rig:
        results: dict[str, Served] = {}
        async with anyio.create_task_group() as tg:
            busy = rig.ticket()
            tg.start_soon(rig.serve_into, results, busy)
            await wait_until(lambda: len(rig.workers.calls) == 1)
            queued = [rig.ticket() for _ in range(3)]
            for ticket in queued:
                tg.start_soon(rig.serve_into, results, ticket)
            await queued_becomes(rig, 3)
            rig.clock.crash_next()
            await wait_until(lambda: rig.clock_task.restarts == 1
                             and rig.clock_task.state is ActorState.RUNNING)
            assert (await rig.stats())["queued"] == {MODEL: 3} and not results
            # Worker b joins: only the restarted clock task can dispatch onto it (no
            # attempt ends meanwhile), and it does, from the queue kept across the crash:
            # all three are served while a is still busy.
            rig.directory.publish(RegistrySnapshot(version=2, workers=(
                *records, record("b", model=MODEL, slots=1))), 2)
            await wait_until(lambda: all(t.request_id in results for t in queued), timeout=5.0)
            hold.set()
        for ticket in [busy, *queued]:
            assert_served_fully(results[ticket.request_id])
        assert [c.worker_id for c in rig.workers.calls] == ["a", "b", "b", "b"]
        await eventually_idle(rig)


async def test_admission_refusals_are_immediate_and_never_reach_a_worker() -> None:
    policy = make_policy(scheduling={"max_queue": 1})
    hold = anyio.Event()
    async with running(*one_slot(policy, hold)) as rig:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.serve, rig.ticket())
            await wait_until(lambda: len(rig.workers.calls) == 1)
            # The slot is busy and nothing has been measured: the predicted wait is 1 s.
            too_soon = await rig.serve(rig.ticket(deadline_s=0.5))
            queued = rig.ticket()
            tg.start_soon(rig.serve, queued)
            await queued_becomes(rig, 1)
            queue_full = await rig.serve(rig.ticket())
            hold.set()
        refusals = {"deadline": too_soon, "queue_full": queue_full}
        for reason, served in refusals.items():
            assert served.refused is not None
            assert (served.refused.status, served.refused.reason) == (503, reason)
            error = served.refused.to_error()
            assert error.status == 503 and error.headers()[0][0] == b"retry-after"
            assert served.elapsed < 0.05
        assert len(rig.workers.calls) == 2  # the busy one and the queued one
        assert rig.workers.calls[1].request_id == queued.request_id
        await eventually_idle(rig)


async def test_tenant_over_its_concurrency_gets_429_without_a_worker_request() -> None:
    policy = make_policy(tenants=tenant_limits(max_concurrency=1))
    hold = anyio.Event()
    async with running(policy, {"a": Behaviour(hold=hold)}) as rig:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.serve, rig.ticket())
            await wait_until(lambda: len(rig.workers.calls) == 1)
            served = await rig.serve(rig.ticket())
            hold.set()
        assert served.refused is not None
        assert (served.refused.status, served.refused.reason) == (429, "concurrency")
        assert served.refused.to_error().status == 429
        assert len(rig.workers.calls) == 1
        await eventually_idle(rig)


async def test_no_worker_for_the_model_is_refused_with_503() -> None:
    async with running(make_policy(), {"a": Behaviour()},
                       records=[record("a", model="another-model")]) as rig:
        served = await rig.serve(rig.ticket())
        assert served.refused is not None
        assert (served.refused.status, served.refused.reason) == (503, "no_healthy_worker")
        assert rig.workers.calls == []


# -- 9. the client goes away before its first attempt -------------------------------


async def test_client_gone_while_queued_withdraws_the_ticket() -> None:
    policy = make_policy(tenants=tenant_limits(max_concurrency=2))
    hold = anyio.Event()
    async with running(*one_slot(policy, hold)) as rig:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.serve, rig.ticket())
            await wait_until(lambda: len(rig.workers.calls) == 1)
            gone = rig.ticket()
            assert await rig.admitted(gone)
            with anyio.move_on_after(0.1):  # the client leaves while queued
                await rig.dispatcher.first_token(gone, rig.call(gone))
            stats = await rig.stats()
            assert stats["queued"][MODEL] == 0
            # No ticket_done was called, yet the tenant's slot is free again.
            nxt = rig.ticket()
            assert await rig.admitted(nxt)
            rig.withdraw(nxt)
            hold.set()
        await eventually_idle(rig)
        assert rig.workers.calls_for(gone.request_id) == []
        assert len(rig.workers.calls) == 1


async def test_client_gone_just_as_its_worker_was_assigned_frees_the_slot() -> None:
    async with running(make_policy(), {"a": Behaviour()},
                       records=[record("a", model=MODEL, slots=1)]) as rig:
        gone = rig.ticket()
        assert await rig.admitted(gone)  # assigned at once
        assert (await rig.stats())["inflight"] == {"a": 1}
        with anyio.CancelScope() as scope:
            scope.cancel()  # the client has already left when the dispatcher looks
            await rig.dispatcher.first_token(gone, rig.call(gone))
        await rig.scheduler.ticket_done(gone, 0)
        await eventually_idle(rig)
        assert rig.workers.calls == []
        served = await rig.serve(rig.ticket())  # the only slot is usable again
        assert_served_fully(served)
        assert served.elapsed < 0.5


def failing_close(rig: Rig) -> list[str]:
    """Make every winning attempt's ``aclose`` raise after closing (a connection that
    errors as it is torn down); the list collects the worker of each."""
    closed: list[str] = []
    first_token = rig.dispatcher.first_token

    async def first_token_failing_close(ticket: Ticket, call: UpstreamCall) -> Attempt:
        attempt = await first_token(ticket, call)
        aclose = attempt.aclose

        async def raising_aclose() -> None:
            await aclose()
            closed.append(attempt.worker_id)
            raise OSError("injected: the connection broke as it was closed")

        attempt.aclose = raising_aclose  # type: ignore[method-assign]
        return attempt

    rig.dispatcher.first_token = first_token_failing_close  # type: ignore[method-assign]
    return closed


async def test_an_attempt_whose_close_fails_still_frees_its_slot_and_ticket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One worker slot, one request at a time for the tenant: a leak of either
    # would leave the next request queued or refused (429) forever.
    policy = make_policy(tenants=tenant_limits(max_concurrency=1))
    async with running(policy, {"a": Behaviour()},
                       records=[record("a", model=MODEL, slots=1)]) as rig:
        closed = failing_close(rig)
        first = await rig.serve(rig.ticket())
        assert_served_fully(first)  # the client never notices
        assert closed == ["a"] and first.ticket.finished
        assert (await rig.stats())["inflight"] == {}
        assert f"{first.ticket.request_id}: closing the stream from worker a failed" in caplog.text
        with anyio.fail_after(2):
            nxt = await rig.serve(rig.ticket())
        assert_served_fully(nxt)  # the slot and the tenant's concurrency were given back
        assert closed == ["a", "a"]
        assert (await rig.stats())["breakers"]["a"] == "closed"


async def test_an_attempt_whose_events_fail_to_close_still_closes_its_connection() -> None:
    closed: list[str] = []

    class Response:
        status, headers = 200, {"content-type": "text/event-stream"}

        async def chunks(self) -> AsyncIterator[bytes]:
            yield b""

        async def read_all(self, limit: int) -> bytes:
            return b""

        async def aclose(self) -> None:
            closed.append("connection")

    async def events() -> AsyncIterator[SseEvent]:
        try:
            yield SseEvent(data="[DONE]")
            await anyio.sleep_forever()
        finally:
            raise OSError("injected: the stream broke as it was closed")

    class Span:
        def end(self) -> None:
            closed.append("span")

    stream = events()
    await stream.__anext__()  # started, as a relayed stream is
    attempt = Attempt(record("a", model=MODEL), False, Response(), stream, span=Span())
    with pytest.raises(OSError, match="injected"):
        await attempt.aclose()
    assert closed == ["connection", "span"]


async def test_attempt_done_for_every_attempt_keeps_slots_balanced() -> None:
    # A mixed run: hedges, retries, pass-throughs; afterwards nothing is held.
    policy = make_policy(hedging={"floor_ms": 40, "ceiling_ms": 40})
    behaviours = {"a": Behaviour(first_token_after_s=0.1), "b": Behaviour(status=500),
                  "c": Behaviour(token_gap_s=0.01)}
    async with running(policy, behaviours) as rig:
        results: dict[str, Served] = {}
        async with anyio.create_task_group() as tg:
            for _ in range(12):
                tg.start_soon(rig.serve_into, results, rig.ticket())
                await anyio.sleep(0.01)
        assert len(results) == 12
        for served in results.values():
            assert_served_fully(served)
        stats = await eventually_idle(rig)
        assert stats["queued"][MODEL] == 0
        assert stats["counters"]["hedges_started"] >= 1 and stats["counters"]["retries"] >= 1
        assert all(c.completed != c.hung_up for c in rig.workers.calls
                   if c.worker_id != "b")
