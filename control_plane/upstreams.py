"""External upstreams: OpenAI-compatible servers that send no heartbeats.

An upstream (llama.cpp's ``llama-server``, vLLM, another Hedgerow) is declared
in the policy's ``upstreams:`` list or registered through the admin API. Since
it never heartbeats, the control plane probes it: ``GET url + health_path``
every ``probe_interval_ms`` within ``probe_timeout_ms``. While its probes
succeed it is a worker in the registry and its lease is renewed; on a failed
probe it is deregistered at once (and were the prober itself to stop, its
lease would lapse on its own), so gateways stop routing to it.

``UpstreamBook`` is the sans-IO part (what to probe when, health transitions);
``UpstreamProber`` is the actor that carries out its probes and tells the
registry actor. The book outlives actor restarts, like the registry.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import httpx

from control_plane.policy_store import PolicyVersion
from control_plane.registry_actor import Beat, Deregister, Register
from hedgerow.actors import Actor, ActorRef
from hedgerow.errors import InvalidRequest, UnknownWorker
from hedgerow.latest import LatestValue
from hedgerow.wire import WorkerLoad, WorkerRegistration
from policies.schema import Upstream

log = logging.getLogger("hedgerow.control_plane.upstreams")

MAX_API_UPSTREAMS = 256
ASK_TIMEOUT_S = 5.0
Health = Literal["unknown", "healthy", "unhealthy"]
Source = Literal["policy", "api"]


def registration_for(spec: Upstream) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=spec.name, url=spec.url, kind=spec.kind, models=spec.models,
        embedding_models=spec.embedding_models,
        slots=spec.slots, labels=spec.labels, external=True, model_map=spec.model_map,
        api_key_env=spec.api_key_env)


@dataclass
class _Tracked:
    spec: Upstream
    source: Source
    health: Health = "unknown"
    next_probe_at: float = 0.0
    last_error: str | None = None


@dataclass
class UpstreamBook:
    """Which upstreams exist, whence, and how their probes went (sans-IO)."""

    tracked: dict[str, _Tracked] = field(default_factory=dict)
    policy_version: int = 0

    def set_policy(self, upstreams: tuple[Upstream, ...], version: int) -> list[Upstream]:
        """Adopt the policy's list (it wins over the API's for a name); return the
        upstreams to take out of the registry: dropped, changed or replaced."""
        self.policy_version = version
        wanted = {spec.name: spec for spec in upstreams}
        gone: list[Upstream] = []
        for name, tracked in list(self.tracked.items()):
            spec = wanted.get(name)
            if spec == tracked.spec:
                tracked.source = "policy"
            elif spec is not None or tracked.source == "policy":
                gone.append(tracked.spec)
                del self.tracked[name]
        for name, spec in wanted.items():
            self.tracked.setdefault(name, _Tracked(spec, "policy"))
        return gone

    def add(self, spec: Upstream) -> None:
        current = self.tracked.get(spec.name)
        if current is not None and current.source == "policy":
            raise InvalidRequest(f"upstream {spec.name!r} is declared in the policy; "
                                 "change it there", code="upstream_in_policy")
        if current is None and self._api_count() >= MAX_API_UPSTREAMS:
            raise InvalidRequest(f"at most {MAX_API_UPSTREAMS} upstreams may be registered "
                                 "through the API", code="too_many_upstreams")
        if current is None or current.spec != spec:
            self.tracked[spec.name] = _Tracked(spec, "api")

    def remove(self, name: str) -> Upstream:
        current = self.tracked.get(name)
        if current is None or current.source != "api":
            where = "is declared in the policy" if current else "is not registered"
            raise UnknownWorker(f"upstream {name!r} {where}")
        del self.tracked[name]
        return current.spec

    def due(self, now: float) -> list[Upstream]:
        return [t.spec for t in self.tracked.values() if t.next_probe_at <= now]

    def record(self, name: str, ok: bool, error: str | None, now: float) -> Health | None:
        """A probe's result; returns the new health when it changed."""
        tracked = self.tracked.get(name)
        if tracked is None:  # removed while its probe ran
            return None
        tracked.next_probe_at = now + tracked.spec.probe_interval_ms / 1000
        tracked.last_error = error
        health: Health = "healthy" if ok else "unhealthy"
        if health == tracked.health:
            return None
        tracked.health = health
        return health

    def healthy(self) -> list[Upstream]:
        return [t.spec for t in self.tracked.values() if t.health == "healthy"]

    def rows(self) -> list[dict[str, Any]]:
        return [{"name": name, "source": t.source, "health": t.health, "url": t.spec.url,
                 "models": list(t.spec.models),
                 "embedding_models": list(t.spec.embedding_models), "last_error": t.last_error}
                for name, t in sorted(self.tracked.items())]

    def _api_count(self) -> int:
        return sum(1 for t in self.tracked.values() if t.source == "api")


async def probe(client: httpx.AsyncClient, spec: Upstream) -> str | None:
    """None when the upstream answered its health path with a 2xx; else why not."""
    headers = {}
    key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        with anyio.fail_after(spec.probe_timeout_ms / 1000):
            response = await client.get(spec.url + spec.health_path, headers=headers)
    except TimeoutError:
        return f"no answer within {spec.probe_timeout_ms} ms"
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"
    return None if 200 <= response.status_code < 300 else f"HTTP {response.status_code}"


@dataclass(frozen=True)
class AddUpstream:
    spec: Upstream


@dataclass(frozen=True)
class RemoveUpstream:
    name: str


@dataclass(frozen=True)
class ListUpstreams:
    pass


class UpstreamProber(Actor):
    tick_interval = 0.05

    def __init__(self, book: UpstreamBook, registry: ActorRef,
                 policy: LatestValue[PolicyVersion], lease_s: float) -> None:
        self.book = book
        self.registry = registry
        self.policy = policy
        self.renew_every_s = lease_s / 3
        self.renewed_at = 0.0
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(5.0), follow_redirects=False)

    async def on_stop(self) -> None:
        await self.client.aclose()

    async def receive(self, message: Any) -> Any:
        match message:
            case AddUpstream(spec):
                self.book.add(spec)
                return registration_for(spec)
            case RemoveUpstream(name):
                await self._leave(self.book.remove(name))
                return None
            case ListUpstreams():
                return self.book.rows()
            case _:
                raise TypeError(f"unexpected message {message!r}")

    async def on_tick(self) -> None:
        if self.policy.version != self.book.policy_version:
            current = self.policy.value
            for spec in self.book.set_policy(current.policy.upstreams, self.policy.version):
                await self._leave(spec)
        await self._probe_due()
        if time.monotonic() - self.renewed_at >= self.renew_every_s:
            self.renewed_at = time.monotonic()
            for spec in self.book.healthy():
                await self._renew(spec)

    async def _probe_due(self) -> None:
        results: dict[str, str | None] = {}
        due = self.book.due(time.monotonic())

        async def one(spec: Upstream) -> None:
            results[spec.name] = await probe(self.client, spec)

        async with anyio.create_task_group() as tg:
            for spec in due:
                tg.start_soon(one, spec)
        for spec in due:
            error = results[spec.name]
            change = self.book.record(spec.name, error is None, error, time.monotonic())
            if change == "healthy":
                log.info("upstream %s at %s is healthy; routing to it", spec.name, spec.url)
                await self.registry.ask(Register(registration_for(spec)), timeout=ASK_TIMEOUT_S)
            elif change == "unhealthy":
                log.warning("upstream %s at %s is unhealthy (%s); not routing to it",
                            spec.name, spec.url, error)
                await self._leave(spec)

    async def _renew(self, spec: Upstream) -> None:
        try:
            await self.registry.ask(Beat(spec.name, WorkerLoad()), timeout=ASK_TIMEOUT_S)
        except UnknownWorker:  # its lease lapsed (e.g. a stall): list it again
            await self.registry.ask(Register(registration_for(spec)), timeout=ASK_TIMEOUT_S)

    async def _leave(self, spec: Upstream) -> None:
        try:
            await self.registry.ask(Deregister(spec.name), timeout=ASK_TIMEOUT_S)
        except UnknownWorker:
            pass  # never listed, or its lease already lapsed: the outcome we want
