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
from hedgerow.redis_conn import RedisTls, check_redis
from hedgerow.redis_conn import open_redis as open_redis_client
from hedgerow.wire import RegistrySnapshot

# Short timeouts: a Redis outage must fail an HTTP request (503) well within
# the ask timeout, not hang it.
REDIS_TIMEOUT_S = 1.0


def open_redis(url: str, tls: RedisTls = RedisTls()) -> Redis:
    """A pooled client (TLS per ``hedgerow.redis_conn``); it connects lazily and
    reconnects by itself."""
    return open_redis_client(url, tls, socket_timeout=REDIS_TIMEOUT_S,
                             connect_timeout=REDIS_TIMEOUT_S, health_check_interval=5)


@asynccontextmanager
async def shared_redis(url: str | None, tls: RedisTls = RedisTls()) -> AsyncIterator[Redis | None]:
    """The replicas' Redis (None without a URL), checked at start and closed at exit.

    A wrong CA, password or ACL stops the start (``RedisSetupError``); an
    unreachable Redis does not: the replica serves what it knows until it is back."""
    if not url:
        yield None
        return
    redis = open_redis(url, tls)
    try:
        await check_redis(redis, url, tls, what="shared state (Redis)")
        yield redis
    finally:
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
