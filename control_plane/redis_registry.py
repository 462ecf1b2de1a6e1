"""The worker registry in Redis, shared by every control-plane replica.

The async twin of ``Registry``. Each worker is two keys that expire together
after the lease — ``…:worker:<id>`` (its registration) and ``…:load:<id>``
(its last load) — so a lease is an expiring key and a replica that dies takes
nothing with it. A set lists the members; a counter is the shared version.
Every change runs as one Lua script, so two replicas never interleave halves
of a change: a worker whose keys expired is removed from the set, and the
version bumped, by exactly one replica's ``expire``. Redis Cluster is not
supported (scripts build key names).

``RedisRegistryActor`` is the replica's side: it answers the HTTP handlers and
on each tick expires leases and republishes the shared snapshot whenever the
shared version moved, whichever replica moved it. When Redis is unreachable
it keeps serving the last snapshot it saw, refuses writes with 503, logs one
line per outage and carries on when Redis is back. If Redis restarted empty,
the version counter is lifted back above what this replica last published, so
gateways' watch streams keep seeing increasing versions, and the workers this
replica last published are put back on fresh leases, so gateways never see an
empty fleet in between (a worker that missed that still re-registers on its
next heartbeat's 404).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from control_plane.metrics import ControlPlaneMetrics
from control_plane.registry import MAX_WORKERS
from control_plane.registry_actor import Beat, Deregister, Register, Snapshot
from hedgerow.actors import Actor
from hedgerow.errors import SharedStateUnavailable, UnknownWorker
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration

log = logging.getLogger("hedgerow.control_plane")

DEFAULT_PREFIX = "hedgerow"

# KEYS: members, version. ARGV: prefix, id, registration, load, lease_ms, max_workers.
_REGISTER = """
local known = redis.call('SISMEMBER', KEYS[1], ARGV[2]) == 1
if not known and redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[6]) then return -1 end
redis.call('SET', ARGV[1] .. ':worker:' .. ARGV[2], ARGV[3], 'PX', ARGV[5])
redis.call('SET', ARGV[1] .. ':load:' .. ARGV[2], ARGV[4], 'PX', ARGV[5])
redis.call('SADD', KEYS[1], ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS: version. ARGV: prefix, id, load, lease_ms. -1: unknown worker.
_HEARTBEAT = """
local worker = ARGV[1] .. ':worker:' .. ARGV[2]
if redis.call('PEXPIRE', worker, ARGV[4]) == 0 then return -1 end
local old = redis.call('SET', ARGV[1] .. ':load:' .. ARGV[2], ARGV[3], 'PX', ARGV[4], 'GET')
if old ~= ARGV[3] then return redis.call('INCR', KEYS[1]) end
return 0
"""

# KEYS: members, version. ARGV: prefix, id. -1: unknown worker.
_DEREGISTER = """
local gone = redis.call('DEL', ARGV[1] .. ':worker:' .. ARGV[2])
redis.call('DEL', ARGV[1] .. ':load:' .. ARGV[2])
if redis.call('SREM', KEYS[1], ARGV[2]) == 0 and gone == 0 then return -1 end
return redis.call('INCR', KEYS[2])
"""

# KEYS: members, version. ARGV: prefix. Returns the ids whose lease ran out.
_EXPIRE = """
local dead = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. ':worker:' .. id) == 0 then
    redis.call('SREM', KEYS[1], id)
    redis.call('DEL', ARGV[1] .. ':load:' .. id)
    table.insert(dead, id)
  end
end
if #dead > 0 then redis.call('INCR', KEYS[2]) end
return dead
"""

# KEYS: members, version. ARGV: prefix. {version, {id, registration, load, pttl}...}
_SNAPSHOT = """
local rows = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local reg = redis.call('GET', ARGV[1] .. ':worker:' .. id)
  if reg then
    local load = redis.call('GET', ARGV[1] .. ':load:' .. id) or ''
    table.insert(rows, {id, reg, load, redis.call('PTTL', ARGV[1] .. ':worker:' .. id)})
  end
end
return {tonumber(redis.call('GET', KEYS[2]) or '0'), rows}
"""

# KEYS: version. ARGV: floor. Lifts the counter past ``floor`` (after a Redis
# restart lost it) so versions never go backwards for watchers, and the
# (now empty) registry is published as a new version.
_FLOOR = """
local now = tonumber(redis.call('GET', KEYS[1]) or '0')
if now < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1] + 1) return 1 end
return 0
"""


class RedisRegistry:
    """Registry operations against Redis; every method may raise ``RedisError``."""

    def __init__(self, redis: Redis, lease_s: float = 3.0, *, prefix: str = DEFAULT_PREFIX,
                 max_workers: int = MAX_WORKERS) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.redis = redis
        self.lease_s = lease_s
        self.max_workers = max_workers
        self.prefix = prefix
        self._members = f"{prefix}:workers"
        self._version = f"{prefix}:registry:version"
        self._register = redis.register_script(_REGISTER)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._deregister = redis.register_script(_DEREGISTER)
        self._expire = redis.register_script(_EXPIRE)
        self._snapshot = redis.register_script(_SNAPSHOT)
        self._floor = redis.register_script(_FLOOR)

    @property
    def _lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))

    async def register(self, registration: WorkerRegistration,
                       load: WorkerLoad | None = None) -> int:
        """Add or replace a worker (load reset unless given, lease renewed); the new version."""
        version = int(await self._register(
            keys=[self._members, self._version],
            args=[self.prefix, registration.worker_id, registration.model_dump_json(),
                  (load or WorkerLoad()).model_dump_json(), self._lease_ms, self.max_workers]))
        if version < 0:
            raise OverflowError(f"registry is full ({self.max_workers} workers)")
        return version

    async def heartbeat(self, worker_id: str, load: WorkerLoad) -> None:
        answer = int(await self._heartbeat(
            keys=[self._version],
            args=[self.prefix, worker_id, load.model_dump_json(), self._lease_ms]))
        if answer < 0:
            raise UnknownWorker(f"worker {worker_id!r} is not registered")

    async def deregister(self, worker_id: str) -> None:
        answer = int(await self._deregister(keys=[self._members, self._version],
                                            args=[self.prefix, worker_id]))
        if answer < 0:
            raise UnknownWorker(f"worker {worker_id!r} is not registered")

    async def expire(self) -> tuple[str, ...]:
        """Forget workers whose lease keys expired; their ids (each seen by one replica)."""
        dead = await self._expire(keys=[self._members, self._version], args=[self.prefix])
        return tuple(sorted(_text(worker_id) for worker_id in dead))

    async def version(self) -> int:
        return int(await self.redis.get(self._version) or 0)

    async def ensure_version_at_least(self, floor: int) -> bool:
        """True if the shared counter was behind ``floor`` (Redis lost its state)."""
        return bool(await self._floor(keys=[self._version], args=[floor]))

    async def snapshot(self) -> RegistrySnapshot:
        version, rows = await self._snapshot(keys=[self._members, self._version],
                                             args=[self.prefix])
        records = [_record(row) for row in rows]
        records.sort(key=lambda record: record.registration.worker_id)
        return RegistrySnapshot(version=int(version), workers=tuple(records))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _record(row: list[Any]) -> WorkerRecord:
    _, registration, load, pttl = row
    return WorkerRecord(
        registration=WorkerRegistration.model_validate_json(registration),
        load=WorkerLoad.model_validate_json(load) if load else WorkerLoad(),
        lease_expires_in_s=round(max(0, int(pttl)) / 1000, 3))


class RedisRegistryActor(Actor):
    """``RegistryActor``'s messages, answered from the shared registry in Redis."""

    tick_interval = 0.2

    def __init__(self, registry: RedisRegistry, published: LatestValue[RegistrySnapshot],
                 metrics: ControlPlaneMetrics, outage: RedisOutage) -> None:
        self.registry = registry
        self.published = published
        self.metrics = metrics
        self.outage = outage

    async def on_start(self) -> None:
        await self.on_tick()

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Snapshot):
            return await self._snapshot_or_last()
        try:
            await self._change(message)
        except RedisError as error:
            self.outage.failed(error)
            raise SharedStateUnavailable(f"registry store unreachable: {error}") from None
        self.outage.recovered()
        await self._refresh()
        return None

    async def _change(self, message: Any) -> None:
        match message:
            case Register(registration):
                await self.registry.register(registration)
                self.metrics.registrations.inc()
                log.info("worker %s registered at %s", registration.worker_id, registration.url)
            case Beat(worker_id, load):
                await self.registry.heartbeat(worker_id, load)
            case Deregister(worker_id):
                await self.registry.deregister(worker_id)
                self.metrics.deregistrations.inc()
                log.info("worker %s deregistered", worker_id)
            case _:
                raise TypeError(f"unexpected message {message!r}")

    async def on_tick(self) -> None:
        try:
            if await self.registry.ensure_version_at_least(self.published.version):
                await self._reseed()
            dead = await self.registry.expire()
            await self._refresh()
        except RedisError as error:
            self.outage.failed(error)
            return
        self.outage.recovered()
        if dead:
            self.metrics.expiries.inc(len(dead))
        for worker_id in dead:
            log.warning("worker %s missed its heartbeats; lease expired", worker_id)

    async def _reseed(self) -> None:
        """Redis came back without the registry: put back the workers this replica
        last published, each on a fresh lease. Until their next heartbeat (which
        then simply renews it) gateways would otherwise see no worker at all; one
        that really died meanwhile expires with its lease as usual."""
        workers = self.published.value.workers
        for record in workers:
            await self.registry.register(record.registration, record.load)
        log.warning("registry: redis lost its state; re-seeded %d worker(s) this replica "
                    "knew", len(workers))

    async def _snapshot_or_last(self) -> RegistrySnapshot:
        try:
            return await self.registry.snapshot()
        except RedisError as error:
            self.outage.failed(error)
            return self.published.value  # the last registry this replica knew

    async def _refresh(self) -> None:
        if await self.registry.version() > self.published.version:
            snapshot = await self.registry.snapshot()
            self.published.publish(snapshot, snapshot.version)


class RedisOutage:
    """One log line when Redis stops answering, one when it is back (sans-IO)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.down_since: float | None = None

    def failed(self, error: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.error("%s: redis unreachable (%s); serving the last known state",
                      self.what, error)

    def recovered(self) -> None:
        if self.down_since is not None:
            log.warning("%s: redis is back after %.1f s", self.what,
                        time.monotonic() - self.down_since)
            self.down_since = None
