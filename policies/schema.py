"""The policy schema: what an operator can tune, validated strictly.

Unknown keys are errors (a typo must never be silently ignored). The policy
issue grows this schema; the shipped default lives in ``default.yaml``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_POLICY_PATH = Path(__file__).with_name("default.yaml")


class PolicyError(ValueError):
    """A policy document that cannot be accepted; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    max_body_bytes: int = Field(1_048_576, ge=1024, le=64 * 1_048_576)
    max_messages: int = Field(256, ge=1, le=4096)
    max_tokens: int = Field(4096, ge=1)


class PriorityClass(_Strict):
    name: str
    ttft_slo_ms: int = Field(ge=1)
    deadline_ms: int = Field(ge=1)


class Tenant(_Strict):
    name: str
    # The policy never holds raw keys: sha256 hex digests of "Bearer" tokens.
    api_key_sha256: tuple[str, ...] = ()
    class_: str = Field("interactive", alias="class")


class ModelEntry(_Strict):
    name: str
    aliases: tuple[str, ...] = ()


class Policy(_Strict):
    limits: Limits = Limits()
    anonymous_tenant: str | None = None
    classes: tuple[PriorityClass, ...] = ()
    tenants: tuple[Tenant, ...] = ()
    models: tuple[ModelEntry, ...] = ()

    @model_validator(mode="after")
    def _references_resolve(self) -> Policy:
        tenant_names = {t.name for t in self.tenants}
        class_names = {c.name for c in self.classes}
        if self.anonymous_tenant is not None and self.anonymous_tenant not in tenant_names:
            raise ValueError(f"anonymous_tenant {self.anonymous_tenant!r} is not a tenant")
        for tenant in self.tenants:
            if tenant.class_ not in class_names:
                raise ValueError(f"tenant {tenant.name!r} uses unknown class {tenant.class_!r}")
        return self

    def canonical_model(self, requested: str) -> str:
        """Map an alias to its model name; unknown names pass through unchanged."""
        for entry in self.models:
            if requested == entry.name or requested in entry.aliases:
                return entry.name
        return requested

    def declares_model(self, name: str) -> bool:
        return any(entry.name == name for entry in self.models)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        data: Any = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise PolicyError(f"{source}: YAML syntax error: {error}") from None
    try:
        return Policy.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise PolicyError(f"{source}: {where}: {first['msg']}") from None


def load_policy(path: Path = DEFAULT_POLICY_PATH) -> Policy:
    return parse_policy(path.read_text(), str(path))
