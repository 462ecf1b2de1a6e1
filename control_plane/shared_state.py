"""Where the control plane keeps shared state when run with ``--redis URL``.

Several replicas pointed at one Redis share the registry (leases as expiring
keys) and the policy versions; each replica keeps serving what it last knew
while Redis is unreachable. Without a URL everything stays in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from control_plane.metrics import ControlPlaneMetrics
from control_plane.redis_registry import RedisOutage, RedisRegistry, RedisRegistryActor
from hedgerow.actors import Actor
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot

# Short timeouts: a Redis outage must fail an HTTP request (503) well within
# the ask timeout, not hang it.
REDIS_TIMEOUT_S = 1.0


def open_redis(url: str) -> Redis:
    """A pooled client; it connects lazily and reconnects by itself."""
    return Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                          socket_connect_timeout=REDIS_TIMEOUT_S, health_check_interval=5)


@asynccontextmanager
async def close_redis(redis: Redis | None) -> AsyncIterator[None]:
    try:
        yield
    finally:
        if redis is not None:
            await redis.aclose()


def registry_actor_factory(
    redis: Redis | None, lease_s: float, published: LatestValue[RegistrySnapshot],
    metrics: ControlPlaneMetrics,
) -> Callable[[], Actor] | None:
    """The Redis-backed registry actor's factory, or None for the in-memory one."""
    if redis is None:
        return None
    registry, outage = RedisRegistry(redis, lease_s), RedisOutage("registry")
    return lambda: RedisRegistryActor(registry, published, metrics, outage)
