"""Wire types shared by workers, the control plane and gateways.

One module defines each message that crosses a process boundary: worker
registration, heartbeat, the registry snapshots of the watch stream, and the
policy versions of the control plane's admin API.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

WorkerKind = Literal["cpu", "gpu", "sim"]


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerLoad(WireModel):
    active: int = Field(0, ge=0)
    queued: int = Field(0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0)
    draining: bool = False


class WorkerRegistration(WireModel):
    worker_id: str = Field(min_length=1, max_length=128)
    url: str = Field(min_length=1, max_length=512)
    kind: WorkerKind
    device: str | None = None
    device_memory_bytes: int | None = Field(None, ge=0)  # a GPU worker's GPU memory
    models: tuple[str, ...] = Field(min_length=1, max_length=64)
    slots: int = Field(ge=1, le=1024)
    labels: dict[str, str] = Field(default_factory=dict)
    # External upstreams (an OpenAI-compatible server the control plane probes
    # instead of heartbeats): client model name → the upstream's own name, and
    # the NAME of the env var that holds its bearer key. The key itself never
    # enters the registry: each gateway reads it from its own environment.
    external: bool = False
    model_map: dict[str, str] = Field(default_factory=dict)
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    def upstream_model(self, model: str) -> str:
        """The name to send upstream for a model clients call ``model``."""
        return self.model_map.get(model, model)


class Heartbeat(WireModel):
    load: WorkerLoad


class RegisterReply(WireModel):
    worker_id: str
    lease_s: float
    heartbeat_interval_s: float


class WorkerRecord(WireModel):
    registration: WorkerRegistration
    load: WorkerLoad
    lease_expires_in_s: float


class RegistrySnapshot(WireModel):
    """The whole registry at one version; the watch stream sends these."""

    version: int
    workers: tuple[WorkerRecord, ...] = ()

    def serving(self, model: str) -> tuple[WorkerRecord, ...]:
        return tuple(w for w in self.workers if model in w.registration.models)

    def models(self) -> tuple[str, ...]:
        return tuple(sorted({m for w in self.workers for m in w.registration.models}))


class PolicyVersionInfo(WireModel):
    """One accepted policy version, without its text (history entries)."""

    version: int = Field(ge=1)
    checksum: str  # sha256 hex of the canonical policy: formatting does not change it
    applied_at: float  # seconds since the epoch
    source: str  # the file, "api", or "rollback to vN"


class PolicyVersionText(PolicyVersionInfo):
    """A policy version with the YAML text as the operator wrote it."""

    text: str


class PolicyHistory(WireModel):
    current: int
    versions: tuple[PolicyVersionInfo, ...]  # oldest first; bounded


class PolicyApplied(PolicyVersionInfo):
    """The answer to an apply or rollback: the version now active."""

    changed: bool  # False: identical content was already active; nothing changed


class PolicyValidated(WireModel):
    checksum: str
