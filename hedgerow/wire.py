"""Wire types shared by workers, the control plane and gateways.

One module defines each message that crosses a process boundary: worker
registration, heartbeat, the registry snapshots of the watch stream, and the
policy versions of the control plane's admin API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from hedgerow.endpoints import normalized

WorkerKind = Literal["cpu", "gpu", "sim"]
# Worker ids appear in URL paths (/v1/workers/{id}) and in a response header.
WORKER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
# Registry fields only an operator sets (the policy's ``upstreams:`` or the
# admin API's POST /v1/upstreams), never a worker registering itself:
# ``api_key_env`` makes every gateway send that env var's value as a bearer
# token to the registered URL.
ADMIN_ONLY_FIELDS: dict[str, Any] = {"external": False, "model_map": {}, "api_key_env": None}


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerLoad(WireModel):
    active: int = Field(0, ge=0)
    queued: int = Field(0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0)
    draining: bool = False


class WorkerRegistration(WireModel):
    """The registry's record of a worker or an external upstream, as gateways
    see it. Workers send a ``SelfRegistration``; only the control plane's
    upstream prober writes the operator's fields (external, model_map, api_key_env)."""

    worker_id: str = Field(min_length=1, max_length=128)
    url: str = Field(min_length=1, max_length=512)
    kind: WorkerKind
    device: str | None = None
    device_memory_bytes: int | None = Field(None, ge=0)  # a GPU worker's GPU memory
    models: tuple[str, ...] = Field(max_length=64)  # chat/completions models
    # Models it serves for ``POST /v1/embeddings`` only (listed with ``kind:
    # "embedding"``, never routed chat). Absent in earlier releases: none.
    embedding_models: tuple[str, ...] = Field((), max_length=64)
    slots: int = Field(ge=1, le=1024)
    labels: dict[str, str] = Field(default_factory=dict)
    # External upstreams (an OpenAI-compatible server the control plane probes
    # instead of heartbeats): client model name → the upstream's own name, and
    # the NAME of the env var that holds its bearer key. The key itself never
    # enters the registry: each gateway reads it from its own environment.
    external: bool = False
    model_map: dict[str, str] = Field(default_factory=dict)
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    @model_validator(mode="after")
    def _serves_something(self) -> WorkerRegistration:
        _require_a_model(self.models, self.embedding_models)
        return self

    def upstream_model(self, model: str) -> str:
        """The name to send upstream for a model clients call ``model``."""
        return self.model_map.get(model, model)


def _require_a_model(models: tuple[str, ...], embedding_models: tuple[str, ...]) -> None:
    if not models and not embedding_models:
        raise ValueError("a worker serves at least one model (models or embedding_models)")


class AdminOnlyField(ValueError):
    """A self-registration tried to set a field only an operator may set."""

    def __init__(self, field: str) -> None:
        super().__init__(f"{field} cannot be set by a worker registration; external "
                         "upstreams are declared in the policy (upstreams:) or through the "
                         "admin API (POST /v1/upstreams)")
        self.field = field


class SelfRegistration(WireModel):
    """What a worker sends to register itself (``POST /v1/workers``): the
    registry record less the operator's fields, its URL checked strictly
    (``hedgerow.endpoints``: http(s)://HOST:PORT and nothing more)."""

    worker_id: str = Field(min_length=1, max_length=128, pattern=WORKER_ID_PATTERN)
    url: Annotated[str, AfterValidator(normalized)]
    kind: WorkerKind
    device: str | None = Field(None, max_length=256)
    device_memory_bytes: int | None = Field(None, ge=0)
    models: tuple[Annotated[str, Field(min_length=1, max_length=128)], ...] = Field(
        max_length=64)
    embedding_models: tuple[Annotated[str, Field(min_length=1, max_length=128)], ...] = Field(
        (), max_length=64)
    slots: int = Field(ge=1, le=1024)
    labels: dict[Annotated[str, Field(min_length=1, max_length=64)],
                 Annotated[str, Field(max_length=256)]] = Field(default_factory=dict,
                                                                max_length=32)

    @model_validator(mode="before")
    @classmethod
    def _refuse_admin_fields(cls, data: Any) -> Any:
        """Refuse the operator's fields by name; their defaults, which grant nothing,
        are dropped (a worker of an earlier release still sends them)."""
        if not isinstance(data, dict):
            return data
        for name, default in ADMIN_ONLY_FIELDS.items():
            if name in data and data[name] != default:
                raise AdminOnlyField(name)
        return {k: v for k, v in data.items() if k not in ADMIN_ONLY_FIELDS}

    @model_validator(mode="after")
    def _serves_something(self) -> SelfRegistration:
        _require_a_model(self.models, self.embedding_models)
        return self

    def record(self) -> WorkerRegistration:
        """The registry's record of this worker: never an external upstream."""
        return WorkerRegistration(**self.model_dump())


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

    def embedding_models(self) -> tuple[str, ...]:
        return tuple(sorted({m for w in self.workers for m in w.registration.embedding_models}))

    def serving_embeddings(self, model: str) -> tuple[WorkerRecord, ...]:
        return tuple(w for w in self.workers if model in w.registration.embedding_models)


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
