"""The worker process: load the model, warm it up, register, serve, drain on SIGTERM.

The model is loaded before the server starts, and a warm-up generation runs
while ``/readyz`` answers 503 ``warming``; only then does the worker register
with the control plane, so no request is ever routed to it before it is
ready and none pays model load or first-use time. A worker's ``labels`` carry
its quantization tier (``tier``, ``quant``) for tier routing
(``policies.tiers``).
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus

from hedgerow.actors import Supervisor
from hedgerow.serving import serve_internal
from hedgerow.http_stack import check_versions
from hedgerow.trust.peer import Revocations, require_roles
from hedgerow.trust.process import InternalTls
from hedgerow.wire import SelfRegistration, WorkerLoad
from workers.app import WorkerApp, WorkerState
from workers.backend import Backend
from workers.heartbeat import DeregisterNow, HeartbeatActor
from workers.sim_embeddings import SimEmbedder
from workers.sim_backend import LatencyModel, SimBackend, SlowPeriods

log = logging.getLogger("hedgerow.worker")


@dataclass(frozen=True)
class WorkerOptions:
    control_plane: str = "https://127.0.0.1:8500"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    worker_id: str | None = None
    model_path: Path | None = None
    model_name: str | None = None
    slots: int | None = None  # None: the device's default (4 on a GPU, 1 on the CPU)
    n_ctx: int = 2048
    n_gpu_layers: int | None = None  # None: all layers on a GPU when one is usable, else 0
    labels: dict[str, str] = field(default_factory=dict)
    drain_timeout_s: float = 30.0
    sim: LatencyModel | None = None  # set for `--backend sim`
    sim_seed: int | None = None
    sim_embedding_model: str | None = None  # also serve this simulated embedding model
    sim_slow_periods: SlowPeriods | None = None  # correlated stragglers (`--sim-slow-periods`)
    quant: str | None = None  # serve the bundled model in this quantization (workers.models)
    tier: str | None = None  # advertised as labels["tier"]; the policy maps classes to tiers
    prompt_reuse: bool = True
    prompt_lookup_tokens: int = 0  # prompt-lookup speculative decoding: draft length, 0 = off
    warm_up: bool = True
    # Mutual TLS with the control plane and gateways; None: plain HTTP (tests of the
    # worker alone, --insecure-internal).
    tls: InternalTls | None = None

    def advertised_labels(self) -> dict[str, str]:
        labels = dict(self.labels)
        if self.tier:
            labels["tier"] = self.tier
        if self.quant:
            labels["quant"] = self.quant.lower()
        return labels


def build_sim_backend(options: WorkerOptions) -> Backend:
    """A simulated model (benchmarks and tests) named like the default model unless told otherwise."""
    from workers.models import DEFAULT_MODEL_NAME

    name = options.model_name or DEFAULT_MODEL_NAME
    latency = options.sim or LatencyModel()
    slots = options.slots or 1
    log.info("simulating %s with %d slot(s): %s %s", name, slots, latency,
             options.sim_slow_periods or "")
    return SimBackend(name, slots, latency, options.sim_seed,
                      slow_periods=options.sim_slow_periods)


def build_llama_backend(options: WorkerOptions) -> Backend:
    from workers.device import CPU_DEVICE, detect_device
    from workers.llama_backend import LlamaBackend
    from workers.models import (
        DEFAULT_MODEL_NAME,
        bundled_model_path,
        model_name_for,
        model_variant_path,
    )

    if options.quant and options.model_path is not None:
        raise ValueError("--quant picks a variant of the bundled model; not with --model-path")
    path = options.model_path or (
        model_variant_path(options.quant) if options.quant else bundled_model_path())
    name = options.model_name or (
        DEFAULT_MODEL_NAME if options.model_path is None else model_name_for(path)
    )
    device = detect_device()
    layers = device.gpu_layers if options.n_gpu_layers is None else options.n_gpu_layers
    if layers == 0:
        device = CPU_DEVICE
    slots = options.slots or device.default_slots
    log.info("loading %s from %s with %d slot(s) on %s (%s, gpu layers %d)",
             name, path, slots, device.kind, device.name or "host CPU", layers)
    return LlamaBackend(
        model_path=path,
        model_name=name,
        slots=slots,
        n_ctx=options.n_ctx,
        n_gpu_layers=layers,
        device=device,
        prompt_reuse=options.prompt_reuse,
        prompt_lookup_tokens=options.prompt_lookup_tokens,
    )


def current_load(backend: Backend, state: WorkerState) -> WorkerLoad:
    load = backend.load()
    return WorkerLoad(
        active=load.active,
        queued=load.queued,
        tokens_per_s=round(load.tokens_per_s, 2),
        draining=state.draining,
    )


async def run_worker(
    options: WorkerOptions,
    backend: Backend,
    shutdown: anyio.Event,
    *,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    check_versions()  # the pinned hypercorn/h2, or refuse to start
    worker_id = options.worker_id or default_worker_id(backend)
    state = WorkerState(worker_id=worker_id, ready=False)
    tls = options.tls or InternalTls(None, options.control_plane)
    embedder = (SimEmbedder(options.sim_embedding_model, options.sim_seed)
                if options.sim_embedding_model else None)
    app = WorkerApp(backend, state, embedder)
    # Only gateways (and operators) may call a worker: it holds every tenant's prompts.
    revocations = Revocations(tls.contexts.credentials.directory / "revoked.json"
                              if tls.contexts is not None and tls.contexts.credentials.managed
                              else None)
    served = require_roles(app, ("gateway", "admin"), revocations) if tls.enabled else app
    server_stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(serve_internal, tls=tls.server()), served, options.host,
                              options.port, server_stop)
        renewing = anyio.CancelScope()
        renewer = tls.renewer()
        if renewer is not None:
            tg.start_soon(run_in_scope, renewing, renewer.run)
        await warm_up(backend, options.warm_up)
        state.ready = True
        registration = SelfRegistration(
            worker_id=worker_id,
            url=_url_of(tls.scheme, options.advertise_host or options.host, port),
            kind=backend.kind,
            device=backend.device,
            device_memory_bytes=backend.device_memory_bytes,
            models=backend.models,
            embedding_models=(embedder.model_name,) if embedder else (),
            slots=backend.slots,
            labels=options.advertised_labels(),
        )
        async with Supervisor() as supervisor:
            link = await supervisor.spawn(
                lambda: HeartbeatActor(options.control_plane, registration,
                                       lambda: current_load(backend, state),
                                       verify=tls.client(), revocations=revocations),
                name="heartbeat",
            )
            log.info("worker %s serving %s on port %d", worker_id, backend.models, port)
            task_status.started(port)
            await shutdown.wait()
            await _drain(options, backend, state, link)
        server_stop.set()
        renewing.cancel()


async def run_in_scope(scope: anyio.CancelScope, run: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await run()


def default_worker_id(backend: Backend) -> str:
    return f"{backend.kind}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


def _url_of(scheme: str, host: str, port: int) -> str:
    """The URL to register: an IPv6 address goes in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def warm_up(backend: Backend, enabled: bool = True) -> None:
    """Run the backend's warm-up generation (if it has one) off the event loop."""
    run = getattr(backend, "warm_up", None)  # the llama backend has one; simulated ones need none
    if not enabled or run is None:
        return
    started = time.monotonic()
    await anyio.to_thread.run_sync(run)
    log.info("warmed up %d slot(s) in %.2f s", backend.slots, time.monotonic() - started)


async def _drain(options: WorkerOptions, backend: Backend, state: WorkerState, link: object) -> None:
    """Leave the registry first, then let running generations finish."""
    state.draining = True
    log.info("draining: deregistering, then waiting for %d active", backend.load().active)
    with anyio.move_on_after(5):
        await link.ask(DeregisterNow(), timeout=5)  # type: ignore[attr-defined]
    with anyio.move_on_after(options.drain_timeout_s):
        while backend.load().active or backend.load().queued:
            await anyio.sleep(0.1)
