"""Control-plane replicas (in this process) sharing one real Redis: each one's
published registry and policy follow changes made through the other, survive
a Redis outage with what they last knew, and re-seed a Redis that restarted
empty."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import pytest
from redis.asyncio import Redis

from control_plane.metrics import ControlPlaneMetrics
from control_plane.policy_actor import ApplyPolicy, GetPolicy
from control_plane.policy_store import PolicyStore, PolicyVersion
from control_plane.redis_policy import RedisPolicyActor, RedisPolicyStore
from control_plane.redis_registry import RedisOutage, RedisRegistry, RedisRegistryActor
from control_plane.registry_actor import Beat, Register, Snapshot
from hedgerow.actors import ActorRef, Supervisor
from hedgerow.errors import SharedStateUnavailable
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRegistration
from policies.loader import parse_policy_document
from tests.support.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

pytestmark = pytest.mark.anyio


def doc(max_tokens: int) -> str:
    return f"limits: {{max_tokens: {max_tokens}}}\n"


WORKER = WorkerRegistration(worker_id="w1", url="http://127.0.0.1:1", kind="cpu",
                            models=("m",), slots=1)


@dataclass
class Replica:
    registry: ActorRef
    workers: LatestValue[RegistrySnapshot]
    policy: ActorRef
    policies: LatestValue[PolicyVersion]


async def start_replica(supervisor: Supervisor, redis: Redis, name: str) -> Replica:
    workers: LatestValue[RegistrySnapshot] = LatestValue(RegistrySnapshot(version=0))
    registry = RedisRegistry(redis, lease_s=5)
    outage = RedisOutage(f"{name} registry")
    metrics = ControlPlaneMetrics(workers)
    registry_ref = await supervisor.spawn(
        lambda: RedisRegistryActor(registry, workers, metrics, outage), name=f"{name}-registry")
    first = PolicyStore(parse_policy_document(doc(100)), doc(100), source=name).current
    policies: LatestValue[PolicyVersion] = LatestValue(first, first.version)
    store, policy_outage = RedisPolicyStore(redis), RedisOutage(f"{name} policy")
    policy_ref = await supervisor.spawn(
        lambda: RedisPolicyActor(store, policies, policy_outage), name=f"{name}-policy")
    return Replica(registry_ref, workers, policy_ref, policies)


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 3) -> None:
    with anyio.fail_after(timeout):
        while True:
            result = check()
            if result if isinstance(result, bool) else await result:
                return
            await anyio.sleep(0.05)


@pytest.fixture
async def two_replicas(redis_server: RedisServer) -> AsyncIterator[tuple[Replica, Replica]]:
    redis_server.restart()  # an empty Redis for every test
    a, b = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
    try:
        async with Supervisor() as supervisor:
            yield (await start_replica(supervisor, a, "a"), await start_replica(supervisor, b, "b"))
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_worker_registered_on_one_replica_is_published_by_the_other(
    two_replicas: tuple[Replica, Replica],
) -> None:
    a, b = two_replicas
    await a.registry.ask(Register(WORKER))
    await eventually(lambda: [w.registration.worker_id for w in b.workers.value.workers] == ["w1"])
    await b.registry.ask(Beat("w1", WorkerLoad(active=1)))  # renewed through the other one
    await eventually(lambda: a.workers.value.workers[0].load.active == 1)


async def test_a_policy_applied_on_one_replica_is_published_by_the_other(
    two_replicas: tuple[Replica, Replica],
) -> None:
    a, b = two_replicas
    applied = await a.policy.ask(ApplyPolicy(doc(200), "edit.yaml"))
    assert applied.version.version == 2
    await eventually(lambda: b.policies.version == 2)
    assert b.policies.value.policy.limits.max_tokens == 200
    assert (await b.policy.ask(GetPolicy(2))).source == "edit.yaml"


async def test_an_outage_serves_the_last_state_and_a_restart_is_reseeded(
    two_replicas: tuple[Replica, Replica], redis_server: RedisServer,
) -> None:
    a, b = two_replicas
    await a.registry.ask(Register(WORKER))
    await a.policy.ask(ApplyPolicy(doc(300), "edit.yaml"))
    await eventually(lambda: b.policies.version == 2 and len(b.workers.value.workers) == 1)
    redis_server.stop()
    snapshot = await b.registry.ask(Snapshot())
    assert [w.registration.worker_id for w in snapshot.workers] == ["w1"]  # last known
    assert (await b.policy.ask(GetPolicy())).version == 2
    with pytest.raises(SharedStateUnavailable):
        await b.policy.ask(ApplyPolicy(doc(400), "during-outage.yaml"))
    with pytest.raises(SharedStateUnavailable):
        await b.registry.ask(Register(WORKER))

    version_before = b.workers.version
    redis_server.start()  # empty: no persistence
    # The replicas put back the worker they last published, on a fresh lease,
    # so watchers never see an empty fleet; nothing heartbeats it here, so it
    # then expires with that lease (5 s) as any silent worker does.
    await eventually(lambda: b.workers.version > version_before, timeout=5)
    assert [w.registration.worker_id for w in b.workers.value.workers] == ["w1"]
    await eventually(lambda: b.workers.value.workers == (), timeout=10)
    assert b.workers.version > 1  # versions never go backwards for watchers
    applied = await b.policy.ask(ApplyPolicy(doc(500), "after.yaml"))
    assert applied.version.version == 3  # v2 was re-seeded, so the count goes on
    await eventually(lambda: a.policies.version == 3)
