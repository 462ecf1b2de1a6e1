"""Versioned operator policy in Redis, shared by every control-plane replica.

The async twin of ``PolicyStore``, with the same rules: a document is
validated here, in this process, with the same loader (``PolicyError``
changes nothing); identical content (same checksum) is a no-op; a rollback is
a new version with an old version's content; the newest ``keep`` versions are
retained. Only the write is shared: one Lua script compares the checksum with
the current one, takes the next number and stores it, so concurrent applies
on two replicas get distinct, increasing versions.

Keys: ``…:policy:current`` (number), ``…:policy:checksum`` (of the current
one), and two hashes by version: ``…:policy:meta`` (checksum, applied_at,
source as JSON) and ``…:policy:text`` (the YAML as applied).

``RedisPolicyActor`` answers ``PolicyActor``'s messages from the shared store
and, on a short tick, follows the current version whichever replica wrote it,
so every replica's policy watch stream sends every version. When Redis is
unreachable, reads answer the last version this replica saw and changes fail
with 503. When Redis comes back empty (it restarted without persistence), the
replica re-seeds it with the last version it knew, number and all.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from control_plane.policy_actor import (
    Applied,
    ApplyPolicy,
    GetPolicy,
    GetPolicyHistory,
    RollbackPolicy,
)
from control_plane.policy_store import DEFAULT_KEEP, PolicyVersion
from control_plane.redis_registry import DEFAULT_PREFIX, RedisOutage
from hedgerow.actors import Actor
from hedgerow.errors import SharedStateUnavailable, UnknownPolicyVersion
from hedgerow.latest import LatestValue
from hedgerow.wire import PolicyVersionInfo
from policies.keys import carry_keys, split_keys_block
from policies.loader import parse_policy_document, policy_checksum
from policies.schema import Policy, PolicyError

log = logging.getLogger("hedgerow.control_plane.policy")

PARSED_CACHE = 8

# KEYS: current, checksum, meta, text. ARGV: checksum, meta, text, keep.
# Returns {version, changed}.
_APPLY = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current > 0 and redis.call('GET', KEYS[2]) == ARGV[1] then return {current, 0} end
local new = current + 1
redis.call('HSET', KEYS[3], new, ARGV[2])
redis.call('HSET', KEYS[4], new, ARGV[3])
redis.call('SET', KEYS[1], new)
redis.call('SET', KEYS[2], ARGV[1])
local old = new - tonumber(ARGV[4])
if old >= 1 then
  redis.call('HDEL', KEYS[3], old)
  redis.call('HDEL', KEYS[4], old)
end
return {new, 1}
"""

# KEYS: as _APPLY. ARGV: version, checksum, meta, text. Writes only into an
# empty store; returns {current version, its checksum} afterwards.
_SEED = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current > 0 then return {current, redis.call('GET', KEYS[2])} end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[1], ARGV[1])
return {tonumber(ARGV[1]), ARGV[2]}
"""


class RedisPolicyStore:
    """Policy versions in Redis; every method may raise ``RedisError``."""

    def __init__(self, redis: Redis, *, prefix: str = DEFAULT_PREFIX,
                 keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.redis = redis
        self.keep = keep
        base = f"{prefix}:policy"
        self._current, self._checksum = f"{base}:current", f"{base}:checksum"
        self._meta, self._text = f"{base}:meta", f"{base}:text"
        self._keys = [self._current, self._checksum, self._meta, self._text]
        self._apply = redis.register_script(_APPLY)
        self._seed = redis.register_script(_SEED)
        self._parsed: OrderedDict[tuple[int, str], Policy] = OrderedDict()

    async def seed(self, version: PolicyVersion) -> tuple[int, str]:
        """Store ``version`` if the store is empty; the current number and
        checksum afterwards."""
        number, checksum = await self._seed(keys=self._keys, args=[
            version.version, version.checksum, _meta(version), version.text])
        return int(number), _text(checksum)

    async def apply(self, text: str, source: str, now: float) -> tuple[PolicyVersion, bool]:
        """Validate (off the event loop) and activate; raises ``PolicyError``.
        Without a keys section the current keys carry over (``policies.keys``)."""
        text = carry_keys(text, await self._current_text())
        policy = await anyio.to_thread.run_sync(parse_policy_document, text, source)
        return await self._activate(policy, text, source, now)

    async def rollback(self, version: int, now: float) -> tuple[PolicyVersion, bool]:
        old = await self.get(version)
        source = f"rollback to v{version}"
        text = carry_keys(split_keys_block(old.text)[0], await self._current_text())
        if text == old.text:
            return await self._activate(old.policy, old.text, source, now)
        policy = await anyio.to_thread.run_sync(parse_policy_document, text, source)
        return await self._activate(policy, text, source, now)

    async def _current_text(self) -> str:
        number = await self.current_version()
        return "" if number == 0 else _text(
            await self.redis.hget(self._text, str(number)))  # type: ignore[misc]

    async def current_version(self) -> int:
        return int(await self.redis.get(self._current) or 0)

    async def current(self) -> PolicyVersion:
        return await self.get(await self.current_version())

    async def get(self, version: int) -> PolicyVersion:
        async with self.redis.pipeline(transaction=True) as both:
            both.hget(self._meta, str(version))
            both.hget(self._text, str(version))
            meta, text = await both.execute()
        if meta is None or text is None:
            raise UnknownPolicyVersion(await self._missing(version))
        fields = orjson.loads(meta)
        source, checksum = fields["source"], fields["checksum"]
        policy = await self._parse(version, checksum, text.decode(), source)
        return PolicyVersion(version, checksum, fields["applied_at"], source, text.decode(),
                             policy)

    async def history(self) -> list[PolicyVersionInfo]:
        """The retained versions, oldest first."""
        rows = await self.redis.hgetall(self._meta)  # type: ignore[misc]
        infos = [PolicyVersionInfo(version=int(number), **orjson.loads(meta))
                 for number, meta in rows.items()]
        return sorted(infos, key=lambda info: info.version)

    async def _activate(self, policy: Policy, text: str, source: str,
                        now: float) -> tuple[PolicyVersion, bool]:
        checksum = policy_checksum(policy)
        candidate = PolicyVersion(0, checksum, now, source, text, policy)
        number, changed = await self._apply(
            keys=self._keys, args=[checksum, _meta(candidate), text, self.keep])
        if not changed:
            return await self.get(int(number)), False
        self._remember(int(number), checksum, policy)
        return PolicyVersion(int(number), checksum, now, source, text, policy), True

    async def _parse(self, version: int, checksum: str, text: str, source: str) -> Policy:
        cached = self._parsed.get((version, checksum))
        if cached is None:
            cached = await anyio.to_thread.run_sync(parse_policy_document, text, source)
            self._remember(version, checksum, cached)
        return cached

    def _remember(self, version: int, checksum: str, policy: Policy) -> None:
        self._parsed[(version, checksum)] = policy
        while len(self._parsed) > PARSED_CACHE:
            self._parsed.popitem(last=False)

    async def _missing(self, version: int) -> str:
        numbers = [int(n) for n in await self.redis.hkeys(self._meta)]  # type: ignore[misc]
        if not numbers:
            return f"no policy version {version}; the store is empty"
        return (f"no policy version {version}; "
                f"versions {min(numbers)}..{max(numbers)} are kept")


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _meta(version: PolicyVersion) -> str:
    return orjson.dumps({"checksum": version.checksum, "applied_at": version.applied_at,
                         "source": version.source}).decode()


class RedisPolicyActor(Actor):
    """``PolicyActor``'s messages, answered from the shared policy store."""

    tick_interval = 0.2

    def __init__(self, store: RedisPolicyStore, published: LatestValue[PolicyVersion],
                 outage: RedisOutage) -> None:
        self.store = store
        self.published = published
        self.outage = outage

    async def on_start(self) -> None:
        await self.on_tick()

    async def on_tick(self) -> None:
        try:
            await self._follow()
        except RedisError as error:
            self.outage.failed(error)
            return
        self.outage.recovered()

    async def receive(self, message: Any) -> Any:
        match message:
            case ApplyPolicy(text, source):
                return await self._change(lambda: self.store.apply(text, source, time.time()),
                                          source)
            case RollbackPolicy(target):
                return await self._change(lambda: self.store.rollback(target, time.time()),
                                          f"rollback to v{target}")
            case GetPolicy(None):
                return await self._read(self.store.current, self.published.value)
            case GetPolicy(int(wanted)):
                return await self._read(lambda: self.store.get(wanted), None)
            case GetPolicyHistory():
                return await self._read(self.store.history, [self.published.value.info()])
            case _:
                raise TypeError(f"unexpected message {message!r}")

    async def _follow(self) -> None:
        """Re-seed an emptied store; publish the shared current version if it moved."""
        known = self.published.value
        number, checksum = await self.store.seed(known)
        if (number, checksum) != (known.version, known.checksum):
            current = await self.store.get(number)
            # replace, not publish: the shared store may hold other content
            # under the number this replica started with (its own file's v1).
            self.published.replace(current, current.version)

    async def _change(self, change: Callable[[], Awaitable[tuple[PolicyVersion, bool]]],
                      source: str) -> Applied:
        before = self.published.version
        try:
            await self.store.seed(self.published.value)
            after, changed = await change()
        except PolicyError as error:
            log.warning("policy from %s rejected; v%d stays active:\n%s", source, before, error)
            raise
        except RedisError as error:
            self.outage.failed(error)
            raise SharedStateUnavailable(f"policy store unreachable: {error}") from None
        if changed:
            log.info("policy v%d active (from %s, checksum %s)",
                     after.version, after.source, after.checksum[:12])
            self.published.publish(after, after.version)
        return Applied(after, changed)

    async def _read(self, read: Callable[[], Awaitable[Any]], fallback: Any) -> Any:
        try:
            return await read()
        except RedisError as error:
            self.outage.failed(error)
            if fallback is None:
                raise SharedStateUnavailable(f"policy store unreachable: {error}") from None
            return fallback
