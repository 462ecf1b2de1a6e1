from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.routing import Candidate
from policies.scoring import RouteRequest, affinity_owner, score_workers


def worker(wid: str, kind: str = "cpu", slots: int = 4, active: int = 0, queued: int = 0,
           speed: float = 0.0, draining: bool = False) -> Candidate:
    return Candidate(worker_id=wid, slots=slots, reported_active=active, reported_queued=queued,
                     draining=draining, kind=kind, tokens_per_s=speed)


SHORT = RouteRequest(prompt_tokens=50, prefer_gpu_above_tokens=512)
LONG = RouteRequest(prompt_tokens=2000, prefer_gpu_above_tokens=512)


def ids(ranked: list[Candidate]) -> list[str]:
    return [c.worker_id for c in ranked]


def test_saturated_draining_and_excluded_workers_are_never_returned() -> None:
    workers = [worker("full", slots=2), worker("drain", draining=True), worker("tried"),
               worker("ok")]
    ranked = score_workers(workers, SHORT, {"full": 2}, exclude={"tried"})
    assert ids(ranked) == ["ok"]
    assert score_workers([worker("full", slots=1)], SHORT, {"full": 1}) == []


def test_least_loaded_relative_to_slots_first() -> None:
    workers = [worker("busy", slots=4, active=3), worker("idle", slots=4),
               worker("big", slots=16, active=4)]
    assert ids(score_workers(workers, SHORT, {})) == ["idle", "big", "busy"]


def test_own_inflight_counts_when_reports_are_stale() -> None:
    workers = [worker("a", active=0), worker("b", active=1)]
    assert ids(score_workers(workers, SHORT, {"a": 3})) == ["b", "a"]


def test_faster_worker_wins_at_equal_load() -> None:
    workers = [worker("slow", speed=20.0, active=1), worker("fast", speed=80.0, active=1),
               worker("unmeasured", active=1)]
    # unmeasured gets the pool's mean measured speed (50 tokens/s)
    assert ids(score_workers(workers, SHORT, {})) == ["fast", "unmeasured", "slow"]


def test_long_prompts_go_to_a_gpu_with_room() -> None:
    workers = [worker("cpu1"), worker("gpu1", kind="gpu", active=3), worker("cpu2")]
    assert ids(score_workers(workers, LONG, {}))[0] == "gpu1"


def test_long_prompts_fall_back_to_cpu_only_when_allowed() -> None:
    workers = [worker("cpu1"), worker("gpu1", kind="gpu", slots=1)]
    assert ids(score_workers(workers, LONG, {"gpu1": 1})) == ["cpu1"]
    strict = RouteRequest(prompt_tokens=2000, prefer_gpu_above_tokens=512,
                          allow_cpu_fallback=False)
    assert score_workers(workers, strict, {"gpu1": 1}) == []
    assert score_workers([worker("cpu1")], strict, {}) == []  # empty GPU pool
    assert ids(score_workers(workers, strict, {})) == ["gpu1"]


def test_short_prompts_go_to_cpu_first_and_overflow_to_gpu() -> None:
    workers = [worker("gpu1", kind="gpu"), worker("cpu1", slots=1)]
    assert ids(score_workers(workers, SHORT, {})) == ["cpu1", "gpu1"]
    assert ids(score_workers(workers, SHORT, {"cpu1": 1})) == ["gpu1"]
    no_fallback = RouteRequest(prompt_tokens=50, allow_cpu_fallback=False)
    assert ids(score_workers(workers, no_fallback, {})) == ["cpu1", "gpu1"]


def test_threshold_zero_sends_everything_to_gpu_first() -> None:
    workers = [worker("cpu1"), worker("gpu1", kind="gpu")]
    request = RouteRequest(prompt_tokens=1, prefer_gpu_above_tokens=0)
    assert ids(score_workers(workers, request, {})) == ["gpu1", "cpu1"]


def test_same_prefix_lands_on_the_same_worker_even_when_busier() -> None:
    workers = [worker(f"w{i}", active=i % 3) for i in range(6)]
    request = RouteRequest(prompt_tokens=50, prefix_key="conversation-42")
    first = score_workers(workers, request, {})[0]
    for inflight in ({}, {first.worker_id: 3}, {"w0": 1, "w5": 2}):
        assert score_workers(workers, request, inflight)[0] == first


def test_prefix_moves_when_its_worker_has_no_room_and_returns_after() -> None:
    workers = [worker(f"w{i}", slots=2) for i in range(5)]
    request = RouteRequest(prompt_tokens=50, prefix_key="conversation-7")
    home = score_workers(workers, request, {})[0].worker_id
    elsewhere = score_workers(workers, request, {home: 2})[0].worker_id
    assert elsewhere != home
    assert score_workers(workers, request, {home: 1})[0].worker_id == home


def test_prefixes_spread_over_workers() -> None:
    workers = [worker(f"w{i}") for i in range(4)]
    owners = {score_workers(workers, RouteRequest(50, prefix_key=f"k{n}"), {})[0].worker_id
              for n in range(200)}
    assert owners == {"w0", "w1", "w2", "w3"}


worker_sets = st.sets(st.sampled_from([f"w{i}" for i in range(12)]), min_size=2, max_size=12)


@given(worker_sets, st.text(min_size=1, max_size=20), st.data())
def test_affinity_moves_minimally_when_a_worker_leaves(
    names: set[str], key: str, data: st.DataObject,
) -> None:
    workers = [worker(n) for n in sorted(names)]
    gone = data.draw(st.sampled_from(sorted(names)))
    before = affinity_owner(key, workers)
    after = affinity_owner(key, [w for w in workers if w.worker_id != gone])
    assert before is not None and after is not None
    if before.worker_id != gone:
        assert after == before


@given(worker_sets, st.text(min_size=1, max_size=20), st.sampled_from(["n1", "n2", "n3"]))
def test_affinity_moves_minimally_when_a_worker_joins(
    names: set[str], key: str, newcomer: str,
) -> None:
    workers = [worker(n) for n in sorted(names)]
    before = affinity_owner(key, workers)
    after = affinity_owner(key, [*workers, worker(newcomer)])
    assert after is not None and after.worker_id in (newcomer, before and before.worker_id)


@given(
    st.lists(st.tuples(st.sampled_from(["cpu", "gpu", "sim"]), st.integers(1, 4),
                       st.integers(0, 6), st.booleans()), max_size=10),
    st.integers(0, 4000), st.booleans(), st.one_of(st.none(), st.text(max_size=8)),
)
def test_only_workers_with_room_are_returned_and_long_prompts_prefer_gpu(
    specs: list[tuple[str, int, int, bool]], prompt: int, fallback: bool, key: str | None,
) -> None:
    workers = [worker(f"w{i}", kind=kind, slots=slots, draining=draining)
               for i, (kind, slots, _, draining) in enumerate(specs)]
    inflight = {f"w{i}": busy for i, (_, _, busy, _) in enumerate(specs)}
    request = RouteRequest(prompt, prefix_key=key, prefer_gpu_above_tokens=512,
                           allow_cpu_fallback=fallback)
    ranked = score_workers(workers, request, inflight)
    assert all(not c.draining and inflight[c.worker_id] < c.slots for c in ranked)
    assert len({c.worker_id for c in ranked}) == len(ranked)
    roomy_gpu = [c for c in workers
                 if c.kind == "gpu" and not c.draining and inflight[c.worker_id] < c.slots]
    if prompt > 512:
        if roomy_gpu:
            assert ranked[0].kind == "gpu"
        if not fallback:
            assert all(c.kind == "gpu" for c in ranked)
    else:
        roomy = [c for c in workers if not c.draining and inflight[c.worker_id] < c.slots]
        assert len(ranked) == len(roomy)
