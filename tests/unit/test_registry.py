from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from control_plane.registry import Registry
from hedgerow.errors import UnknownWorker
from hedgerow.wire import WorkerLoad, WorkerRegistration


def reg(worker_id: str = "w1", models: tuple[str, ...] = ("m",)) -> WorkerRegistration:
    return WorkerRegistration(worker_id=worker_id, url="http://127.0.0.1:1", kind="cpu",
                              models=models, slots=2)


def test_register_then_snapshot_lists_worker_with_lease() -> None:
    registry = Registry(lease_s=3)
    registry.register(reg(), now=10.0)
    snapshot = registry.snapshot(now=11.0)
    assert [w.registration.worker_id for w in snapshot.workers] == ["w1"]
    assert snapshot.workers[0].lease_expires_in_s == pytest.approx(2.0)
    assert snapshot.version == 1


def test_lease_expires_without_heartbeat_and_bumps_version() -> None:
    registry = Registry(lease_s=3)
    registry.register(reg(), now=0.0)
    assert registry.expire(now=2.9) == ()
    version = registry.version
    assert registry.expire(now=3.0) == ("w1",)
    assert "w1" not in registry
    assert registry.version == version + 1


def test_heartbeat_renews_lease() -> None:
    registry = Registry(lease_s=3)
    registry.register(reg(), now=0.0)
    registry.heartbeat("w1", WorkerLoad(), now=2.5)
    assert registry.expire(now=5.0) == ()
    assert registry.expire(now=5.5) == ("w1",)


def test_heartbeat_changes_version_only_when_load_changes() -> None:
    registry = Registry()
    registry.register(reg(), now=0.0)
    v = registry.version
    registry.heartbeat("w1", WorkerLoad(), now=0.5)
    assert registry.version == v
    registry.heartbeat("w1", WorkerLoad(active=1), now=1.0)
    assert registry.version == v + 1
    assert registry.snapshot(1.0).workers[0].load.active == 1


def test_unknown_worker_heartbeat_and_deregister_are_404() -> None:
    registry = Registry()
    with pytest.raises(UnknownWorker) as caught:
        registry.heartbeat("ghost", WorkerLoad(), now=0.0)
    assert caught.value.status == 404
    with pytest.raises(UnknownWorker):
        registry.deregister("ghost")


def test_registry_is_bounded() -> None:
    registry = Registry(max_workers=2)
    registry.register(reg("a"), 0.0)
    registry.register(reg("b"), 0.0)
    registry.register(reg("a"), 1.0)  # re-registration is not growth
    with pytest.raises(OverflowError):
        registry.register(reg("c"), 0.0)


def test_snapshot_serving_filters_by_model() -> None:
    registry = Registry()
    registry.register(reg("a", ("x",)), 0.0)
    registry.register(reg("b", ("x", "y")), 0.0)
    snapshot = registry.snapshot(0.0)
    assert [w.registration.worker_id for w in snapshot.serving("y")] == ["b"]
    assert snapshot.models() == ("x", "y")


@given(st.lists(st.tuples(st.sampled_from(["reg", "beat", "dereg", "expire"]),
                          st.sampled_from(["a", "b", "c"]),
                          st.floats(min_value=0, max_value=2)), max_size=40))
def test_version_is_monotone_and_no_expired_worker_survives(ops: list[tuple[str, str, float]]) -> None:
    registry = Registry(lease_s=1.0)
    now = 0.0
    last_beat: dict[str, float] = {}
    for op, wid, step in ops:
        now += step
        before = registry.version
        if op == "reg":
            registry.register(reg(wid), now)
            last_beat[wid] = now
        elif op == "beat" and wid in registry:
            registry.heartbeat(wid, WorkerLoad(), now)
            last_beat[wid] = now
        elif op == "dereg" and wid in registry:
            registry.deregister(wid)
            last_beat.pop(wid)
        elif op == "expire":
            for dead in registry.expire(now):
                last_beat.pop(dead)
            assert all(now - t < 1.0 for t in last_beat.values())
        assert registry.version >= before
    assert len(registry) == len(last_beat)
