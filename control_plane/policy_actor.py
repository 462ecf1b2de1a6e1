"""The actor that owns the control plane's policy store.

Every change to the active policy goes through it, one message at a time, so
an apply, a rollback and a watched-file change can never interleave. Each new
version is published to a ``LatestValue`` cell for whoever follows it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from control_plane.policy_store import PolicyStore, PolicyVersion
from hedgerow.actors import Actor
from hedgerow.latest import LatestValue
from policies.schema import PolicyError

log = logging.getLogger("hedgerow.control_plane.policy")


@dataclass(frozen=True)
class ApplyPolicy:
    text: str
    source: str


@dataclass(frozen=True)
class RollbackPolicy:
    version: int


@dataclass(frozen=True)
class GetPolicy:
    version: int | None = None  # None: the current one


@dataclass(frozen=True)
class GetPolicyHistory:
    pass


@dataclass(frozen=True)
class Applied:
    """The answer to an apply or rollback: the current version afterwards."""

    version: PolicyVersion
    changed: bool  # False: the content was identical to the current version


class PolicyActor(Actor):
    def __init__(self, store: PolicyStore, published: LatestValue[PolicyVersion]) -> None:
        self.store = store
        self.published = published

    async def on_start(self) -> None:
        self._publish()

    async def receive(self, message: Any) -> Any:
        match message:
            case ApplyPolicy(text, source):
                return await self._change(lambda: self.store.apply(text, source, time.time()),
                                          source)
            case RollbackPolicy(target):
                return await self._change(lambda: self.store.rollback(target, time.time()),
                                          f"rollback to v{target}")
            case GetPolicy(None):
                return self.store.current
            case GetPolicy(int(wanted)):
                return self.store.get(wanted)
            case GetPolicyHistory():
                return self.store.history()
            case _:
                raise TypeError(f"unexpected message {message!r}")

    async def _change(self, change: Callable[[], PolicyVersion], source: str) -> Applied:
        before = self.store.current.version
        try:
            # Validating a large document takes a while: off the event loop. Safe,
            # because this actor handles one message at a time.
            after = await anyio.to_thread.run_sync(change)
        except PolicyError as error:
            log.warning("policy from %s rejected; v%d stays active:\n%s", source, before, error)
            raise
        changed = after.version != before
        if changed:
            log.info("policy v%d active (from %s, checksum %s)",
                     after.version, after.source, after.checksum[:12])
        self._publish()
        return Applied(after, changed)

    def _publish(self) -> None:
        current = self.store.current
        self.published.publish(current, current.version)
