"""The policy side of the control plane, wired up: store, actor, watched directory."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from redis.asyncio import Redis

from control_plane.policy_actor import PolicyActor
from control_plane.policy_api import PolicyApi
from control_plane.policy_store import PolicyStore, PolicyVersion
from control_plane.policy_watch import PolicyDirectoryWatcher
from control_plane.redis_policy import RedisPolicyActor, RedisPolicyStore
from control_plane.redis_registry import RedisOutage
from hedgerow.actors import Actor
from hedgerow.actors import Supervisor
from hedgerow.latest import LatestValue
from policies.loader import decode_policy_bytes, parse_policy_document


def load_initial_store(policy_file: Path) -> PolicyStore:
    """Version 1 from ``policy_file``; raises ``PolicyError`` (there is no last
    good policy to fall back on at start) or ``OSError``."""
    source = str(policy_file)
    text = decode_policy_bytes(policy_file.read_bytes(), source)
    policy = parse_policy_document(text, source)
    return PolicyStore(policy, text, source=source, now=time.time())


async def start_policy_service(
    supervisor: Supervisor, policy_file: Path, policy_dir: Path | None,
    redis: Redis | None = None,
) -> PolicyApi:
    """With ``redis``, versions live there (the file seeds an empty store)."""
    # The store outlives actor restarts, like the registry: versions are never lost.
    store = load_initial_store(policy_file)
    published: LatestValue[PolicyVersion] = LatestValue(store.current, store.current.version)
    factory: Callable[[], Actor] = lambda: PolicyActor(store, published)  # noqa: E731
    if redis is not None:
        shared, outage = RedisPolicyStore(redis), RedisOutage("policy store")
        factory = lambda: RedisPolicyActor(shared, published, outage)  # noqa: E731
    actor = await supervisor.spawn(factory, name="policy")
    if policy_dir is not None:
        watcher = PolicyDirectoryWatcher(policy_dir, actor)
        await watcher.poll()  # the directory's newest file is in force before the API serves
        supervisor.run_service("policy-directory", watcher.run)
    return PolicyApi(actor, published)
