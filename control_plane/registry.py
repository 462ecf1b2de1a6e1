"""The worker registry as a sans-IO state machine with leases.

Every call takes ``now`` (monotonic seconds). A worker's lease is renewed by
each heartbeat; ``expire(now)`` drops workers whose lease ran out. Every change
bumps ``version`` so watchers can tell snapshots apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from hedgerow.errors import UnknownWorker
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration

MAX_WORKERS = 4096


@dataclass
class _Lease:
    registration: WorkerRegistration
    load: WorkerLoad
    expires_at: float


class Registry:
    def __init__(self, lease_s: float = 3.0, max_workers: int = MAX_WORKERS) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.lease_s = lease_s
        self.max_workers = max_workers
        self.version = 0
        self._leases: dict[str, _Lease] = {}

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def register(self, registration: WorkerRegistration, now: float) -> None:
        """Add or replace a worker; a re-registration resets its load and lease."""
        known = registration.worker_id in self._leases
        if not known and len(self._leases) >= self.max_workers:
            raise OverflowError(f"registry is full ({self.max_workers} workers)")
        self._leases[registration.worker_id] = _Lease(
            registration, WorkerLoad(), now + self.lease_s
        )
        self.version += 1

    def heartbeat(self, worker_id: str, load: WorkerLoad, now: float) -> None:
        lease = self._leases.get(worker_id)
        if lease is None:
            raise UnknownWorker(f"worker {worker_id!r} is not registered")
        lease.expires_at = now + self.lease_s
        if lease.load != load:
            lease.load = load
            self.version += 1

    def deregister(self, worker_id: str) -> None:
        if self._leases.pop(worker_id, None) is None:
            raise UnknownWorker(f"worker {worker_id!r} is not registered")
        self.version += 1

    def expire(self, now: float) -> tuple[str, ...]:
        """Drop every worker whose lease has run out; return their ids."""
        dead = tuple(wid for wid, lease in self._leases.items() if lease.expires_at <= now)
        for worker_id in dead:
            del self._leases[worker_id]
        if dead:
            self.version += 1
        return dead

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self._leases.values()), default=None)

    def snapshot(self, now: float) -> RegistrySnapshot:
        records = tuple(
            WorkerRecord(
                registration=lease.registration,
                load=lease.load,
                lease_expires_in_s=round(max(0.0, lease.expires_at - now), 3),
            )
            for _, lease in sorted(self._leases.items())
        )
        return RegistrySnapshot(version=self.version, workers=records)
