"""The soak: mixed traffic for a while, with faults injected, watching for leaks.

``hedgerow bench scenario soak --duration 60`` (not in CI). One gateway in
front of three simulated workers takes open-loop Poisson traffic that mixes
streaming and non-streaming chat, text completions, a rate-limited tenant
(429s) and requests the gateway must refuse (400, 401, 404). Meanwhile a fault every ``FAULT_EVERY_S``, in turn: a worker
SIGKILLed and started again, a worker frozen (SIGSTOP) for ``FREEZE_S`` then
thawed (SIGCONT).

Reported: requests sent and served, errors by kind (status and error code),
the gateway's RSS every ``SAMPLE_EVERY_S`` (and its growth after a warm-up of
``WARMUP_FRACTION`` of the run, at least ``WARMUP_MIN_S``; "flat" means within
``FLAT_WITHIN``), and the
gateway's asyncio task count (``hedgerow_asyncio_tasks``) idle before the
load and idle after it: a leaked task per request would show as growth.
"""

from __future__ import annotations

import hashlib
import logging
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from bench.loadgen import OpenLoop, RequestSpec, Target, http_version_from_env, run_load
from bench.records import LoadResult
from bench.stack import Proc, Stack, free_port, wait_for

log = logging.getLogger("hedgerow.bench.soak")

MODEL = "smollm2-135m-instruct"
DEFAULT_DURATION_S = 60.0
RATE_PER_S = 12.0
FAULT_EVERY_S = 12.0
FREEZE_S = 3.0
SAMPLE_EVERY_S = 2.0
WARMUP_FRACTION = 0.25
# ...but at least this long (up to half the run): finished streams stay
# resumable for ``streams.retain_ms`` (60 s by default), so memory fills
# until then by design.
WARMUP_MIN_S = 75.0
FLAT_WITHIN = 0.10
# Longer than the gateway's keep-alive timeout (5 s) and than the TLS shutdown
# timeout of the event loop (30 s), which a connection whose client vanished
# mid-close waits out before its tasks end.
SETTLE_S = 40.0
SETTLE_SAMPLES = 8
WORKER_ARGS = ["--backend", "sim", "--slots", "4", "--sim-prefill-ms-per-token", "0.2",
               "--sim-decode-ms-per-token", "4", "--sim-jitter", "0.2"]
WORKERS = ("soak-0", "soak-1", "soak-2")
EXPECT_OK = ("stream", "whole", "completion")
PROMPT = "Tell me about hedgerows and the birds that live in them. " * 3


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


POLICY = f"""
timeouts: {{connect_ms: 1000, ttft_ms: 1500, idle_ms: 1500}}
breaker: {{failures_to_open: 2, open_for_ms: 1000, max_open_for_ms: 4000}}
retries: {{before_first_token: 2}}
hedging: {{enabled: true, floor_ms: 100, ceiling_ms: 1000}}
anonymous_tenant: open
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 8000}}
  - {{name: batch, ttft_slo_ms: 5000, deadline_ms: 20000, hedge: false, max_tokens: 64}}
tenants:
  - name: open
    class: interactive
    limits: {{requests_per_s: 1000, requests_burst: 2000, tokens_per_min: 100000000,
              tokens_burst: 10000000, max_concurrency: 10000}}
  - name: metered
    class: batch
    api_key_sha256: ["{_digest('sk-soak-metered')}"]
    limits: {{requests_per_s: 1, requests_burst: 2}}
models:
  - name: {MODEL}
# The semantic cache on (it ships off), as the soak has always run: its
# embedding sidecar lives through the same faults and is in the RSS and tasks.
cache: {{semantic: {{enabled: true}}}}
"""


def soak_factory() -> Callable[[int, random.Random], RequestSpec]:
    def chat(stream: bool, max_tokens: int, content: str = PROMPT) -> dict[str, Any]:
        return {"model": MODEL, "stream": stream, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": content}]}

    def factory(index: int, rng: random.Random) -> RequestSpec:
        roll = rng.random()
        if roll < 0.55:
            return RequestSpec("stream", chat(True, rng.randint(8, 48), f"{PROMPT} ({index})"))
        if roll < 0.70:
            return RequestSpec("whole", chat(False, rng.randint(4, 16)))
        if roll < 0.78:
            return RequestSpec("completion", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                              "stream": rng.random() < 0.5},
                               path="/v1/completions")
        if roll < 0.86:
            return RequestSpec("metered", chat(True, 8),
                               {"authorization": "Bearer sk-soak-metered"})
        if roll < 0.90:
            return RequestSpec("bad_key", chat(True, 8), {"authorization": "Bearer sk-nope"})
        if roll < 0.94:
            return RequestSpec("bad_body", {"model": MODEL, "messages": "not a list"})
        if roll < 0.97:
            return RequestSpec("unknown_model", {**chat(True, 8), "model": "no-such-model"})
        return RequestSpec("too_many_tokens", chat(True, 100_000))
    return factory


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _asyncio_tasks(stack: Stack) -> int:
    for line in stack.gateway_metrics().splitlines():
        if line.startswith("hedgerow_asyncio_tasks "):
            return int(float(line.split()[1]))
    raise RuntimeError("the gateway exports no hedgerow_asyncio_tasks gauge")


class FaultInjector:
    """Every ``FAULT_EVERY_S``: kill-and-restart one worker, or freeze one for a while."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.done: list[dict[str, Any]] = []
        self._turn = 0

    def _proc(self, worker_id: str) -> Proc:
        return [p for p in self.stack.procs if p.name == worker_id][-1]

    def inject(self, at_s: float) -> None:
        worker_id = WORKERS[self._turn % len(WORKERS)]
        proc = self._proc(worker_id)
        if self._turn % 2 == 0:
            proc.popen.kill()
            proc.popen.wait()
            wait_for(lambda: self.stack.worker(worker_id) is None, "the killed worker's lease",
                     timeout=15)
            self.stack.start_worker(worker_id, *WORKER_ARGS)
            self.done.append({"at_s": round(at_s, 1), "fault": "sigkill+restart",
                              "worker": worker_id})
        else:
            proc.popen.send_signal(signal.SIGSTOP)
            time.sleep(FREEZE_S)
            proc.popen.send_signal(signal.SIGCONT)
            self.done.append({"at_s": round(at_s, 1), "fault": f"sigstop {FREEZE_S:g}s",
                              "worker": worker_id})
        self._turn += 1


def _errors_by_kind(result: LoadResult) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for record in result.records:
        if not record.ok:
            kinds[f"{record.error}:{record.status}:{record.error_detail}"] += 1
    return dict(kinds.most_common())


def soak(quick: bool, workdir: Path, duration_s: float | None = None) -> dict[str, Any]:
    duration = duration_s or DEFAULT_DURATION_S
    root = workdir / "soak"
    root.mkdir(parents=True, exist_ok=True)
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(root)
    try:
        stack.start_control_plane(lease_s=2.0)
        for worker_id in WORKERS:
            stack.start_worker(worker_id, *WORKER_ARGS)
        admin = f"https://127.0.0.1:{free_port()}"
        gateway = stack.start_gateway("--policy", str(policy),
                                      "--admin-port", admin.rsplit(":", 1)[1])
        # The embedding sidecar's connection tasks start once its model is
        # loaded: count the idle tasks after that, not before. (The admin
        # listener: mutual TLS as the cluster's admin; no hostname to check.)
        verify = stack.admin_tls(check_hostname=False)
        wait_for(lambda: httpx.get(admin + "/admin/cache", timeout=5, verify=verify).json()
                 ["semantic_ready"], "the gateway's embedding model", 180)
        return _run(stack, gateway.popen.pid, duration)
    finally:
        stack.stop_all()


def _run(stack: Stack, pid: int, duration: float) -> dict[str, Any]:
    time.sleep(1.0)
    tasks_before = _asyncio_tasks(stack)
    target = Target(stack.gateway_url, http_version=http_version_from_env(),
                    ca_file=stack.ca_cert, request_timeout_s=30.0)
    load = OpenLoop(rate_per_s=RATE_PER_S, duration_s=duration, max_in_flight=2000)
    outcome: dict[str, LoadResult] = {}

    def drive() -> None:
        outcome["result"] = anyio.run(lambda: run_load(target, load, soak_factory(), seed=7))

    driver = threading.Thread(target=drive, name="soak-load", daemon=True)
    started = time.monotonic()
    driver.start()
    injector = FaultInjector(stack)
    rss: list[tuple[float, float]] = []
    next_fault = FAULT_EVERY_S
    while driver.is_alive():
        elapsed = time.monotonic() - started
        rss.append((round(elapsed, 1), _rss_mb(pid)))
        if elapsed >= next_fault and elapsed < duration - FAULT_EVERY_S / 2:
            injector.inject(elapsed)
            next_fault += FAULT_EVERY_S
        driver.join(SAMPLE_EVERY_S)
    result = outcome["result"]
    # Connections the load left open close within the keep-alive timeout (or
    # the TLS shutdown timeout); what is still running after that was leaked.
    tasks_settling = []
    for _ in range(SETTLE_SAMPLES):
        time.sleep(SETTLE_S / SETTLE_SAMPLES)
        tasks_settling.append(_asyncio_tasks(stack))
    rss.append((round(time.monotonic() - started, 1), _rss_mb(pid)))
    tasks_after = tasks_settling
    return _summary(result, rss, duration, tasks_before, tasks_after, injector.done)


def _summary(result: LoadResult, rss: list[tuple[float, float]], duration: float,
             tasks_before: int, tasks_after: list[int], faults: list[dict[str, Any]]) -> dict[str, Any]:
    warmup_s = max(duration * WARMUP_FRACTION, min(duration / 2, WARMUP_MIN_S))
    warm = [(t, mb) for t, mb in rss if t >= warmup_s]
    baseline_t, baseline = warm[0] if warm else rss[-1]
    peak_after_warmup = max(mb for _, mb in warm) if warm else baseline
    growth = (rss[-1][1] - baseline) / baseline if baseline else 0.0
    span_min = (rss[-1][0] - baseline_t) / 60
    slope = (rss[-1][1] - baseline) / span_min if span_min > 0 else 0.0
    by_tag: Counter[str] = Counter(r.tag for r in result.records)
    ok_by_tag: Counter[str] = Counter(r.tag for r in result.records if r.ok)
    return {
        "duration_s": duration,
        "offered_rps": RATE_PER_S,
        "requests": len(result.records),
        "served_ok": sum(1 for r in result.records if r.ok),
        "by_tag": {tag: {"sent": n, "ok": ok_by_tag[tag]} for tag, n in sorted(by_tag.items())},
        "errors_by_kind": _errors_by_kind(result),
        # Requests that should have been served (not refused by design) but were not.
        "unexpected_errors": sum(1 for r in result.records
                                 if r.tag in EXPECT_OK and not r.ok),
        "faults": faults,
        "rss_mb": {"start": rss[0][1], "warmup_s": round(warmup_s, 1), "after_warmup": baseline,
                   "peak_after_warmup": peak_after_warmup, "end": rss[-1][1],
                   "growth_after_warmup": round(growth, 4),
                   "mb_per_min_after_warmup": round(slope, 2),
                   "flat_within_10pct": abs(growth) <= FLAT_WITHIN
                   and (peak_after_warmup - baseline) / baseline <= FLAT_WITHIN,
                   "samples": rss},
        "asyncio_tasks": {"idle_before": tasks_before, "after_load_every_5s": tasks_after,
                          "leaked": max(0, tasks_after[-1] - tasks_before)},
    }
