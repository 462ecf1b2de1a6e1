"""Benchmark scenarios: each starts what it needs here and prints one JSON line.

``overload``    mixed interactive/batch traffic at about twice capacity, run
                twice side by side: EDF + admission, then plain FIFO with no
                admission. Shows SLO attainment, what was shed and how fast.
``overhead``    a fixed-latency worker measured directly, through Hedgerow
                and through nginx in interleaved rounds (see ``bench.overhead``).
``internal-tls`` the same gateway and worker with internal mutual TLS and with
                ``--insecure-internal``, interleaved: what mTLS costs per request
                (see ``bench.internal_tls``).
``throughput``  exact cache hits over HTTP/2 through Hedgerow vs a bare
                Hypercorn hello-world app, interleaved, with h2load
                (see ``bench.throughput``).
``stragglers``  2% of requests ten times slower, hedging on and off. Shows
                TTFT percentiles and the extra worker requests hedging cost.
``worker``      the real bundled model in-process (``bench.worker_scenario``):
                prompt reuse across turns, prompt-lookup decoding, warm
                start and quantization tiers.
``pops``        two PoPs in network namespaces over an emulated WAN
                (``bench.pops``): local-first versus locality-blind routing,
                and one PoP's workers all killed. Needs root (``ip netns``).
``cache``       response-cache hit and miss latency through the gateway, semantic
                precision and recall on the paraphrase set (``bench.cache_scenario``).
``attacks``     HTTP/2 floods (rapid reset, the 2019 family), a QUIC Initial flood and a
                per-IP TCP connection flood: per attack, time until the abuser is cut
                or contained, what it got through, and a good client's p50/p99
                before and during it (``bench.attacks``).
``memory``      resident memory of everything a gateway starts (its embedding
                sidecar included) with the shipped policy, semantic cache off
                and cache off (``bench.memory``).
``soak``        mixed traffic with worker kills and freezes for ``--duration``
                seconds; RSS over time, errors by kind, tasks left (``bench.soak``).

The others run simulated workers (a latency model, ``--backend sim``). ``overload``
and ``stragglers`` measure the gateway's scheduling with open-loop Poisson
load whose latencies count from the intended send time. Each scenario writes
PNG plots (latency CDFs, latency over time) next to its process logs in the
working directory (``--workdir`` keeps them).
"""

from __future__ import annotations

import hashlib
import logging
import random
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from bench.loadgen import OpenLoop, RequestSpec, Target, http_version_from_env, run_load
from bench.internal_tls import internal_tls
from bench.overhead import overhead
from bench.records import LoadResult, RequestRecord
from bench.stack import Stack
from bench.stats import fraction_at_most, percentile

log = logging.getLogger("hedgerow.bench")

MODEL = "smollm2-135m-instruct"
PROMPT = "Summarise the following note in one line: " + "the hedge is green and tall. " * 6


def _key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class SimWorker:
    """One simulated worker: its latency model as CLI flags."""

    worker_id: str
    slots: int
    prefill_ms_per_token: float
    decode_ms_per_token: float
    jitter: float = 0.1
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0
    seed: int = 0

    def args(self) -> list[str]:
        return ["--backend", "sim", "--slots", str(self.slots),
                "--sim-prefill-ms-per-token", str(self.prefill_ms_per_token),
                "--sim-decode-ms-per-token", str(self.decode_ms_per_token),
                "--sim-jitter", str(self.jitter),
                "--sim-straggler-prob", str(self.straggler_prob),
                "--sim-straggler-factor", str(self.straggler_factor),
                "--sim-seed", str(self.seed)]


@contextmanager
def running_stack(root: Path, policy_yaml: str, workers: list[SimWorker]) -> Iterator[Stack]:
    root.mkdir(parents=True, exist_ok=True)
    policy = root / "policy.yaml"
    policy.write_text(policy_yaml)
    stack = Stack(root)
    try:
        stack.start_control_plane()
        for worker in workers:
            stack.start_worker(worker.worker_id, *worker.args())
        stack.start_gateway("--policy", str(policy))
        yield stack
    finally:
        stack.stop_all()


def worker_generations(stack: Stack) -> int:
    """Generations the workers started (finished or cancelled): the real worker load."""
    total = 0
    for record in stack.workers():
        status = stack.worker_status(record["registration"]["worker_id"])
        total += int(status["generations_total"]) + int(status["active"])
    return total


def measure(stack: Stack, rate: float, duration_s: float,
            factory: Callable[[int, random.Random], RequestSpec], seed: int) -> LoadResult:
    target = Target(stack.gateway_url, http_version=http_version_from_env(), ca_file=stack.ca_cert,
                    request_timeout_s=120.0)
    load = OpenLoop(rate_per_s=rate, duration_s=duration_s, max_in_flight=4000)
    return anyio.run(lambda: run_load(target, load, factory, seed=seed))


def write_plots(result: LoadResult, out: Path) -> None:
    """TTFT and end-to-end PNGs (CDF, over time) per request tag, next to the run's logs."""
    from bench.run import write_plots as write_run_plots  # matplotlib: only when a scenario runs

    write_run_plots(result, out)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _p(values: list[float], q: float) -> float | None:
    return _ms(percentile(sorted(values), q)) if values else None


# -- overload -------------------------------------------------------------------

OVERLOAD_SLO_S = {"interactive": 0.5, "batch": 10.0}


def overload_policy(mode: str) -> str:
    edf = mode == "edf"
    return f"""
scheduling:
  max_queue: 20000
  slo_admission: {str(edf).lower()}
  order: {"edf" if edf else "fifo"}
  prefill_ms_per_token: 1.0
timeouts: {{connect_ms: 2000, ttft_ms: 120000, idle_ms: 60000}}
hedging: {{enabled: false}}
classes:
  - {{name: interactive, ttft_slo_ms: 500, deadline_ms: 400, hedge: false}}
  - {{name: batch, ttft_slo_ms: 10000, deadline_ms: 5000, hedge: false}}
tenants:
  - name: web
    class: interactive
    api_key_sha256: ["{_key_hash('sk-web')}"]
    limits: {{requests_per_s: 1000, requests_burst: 2000, tokens_per_min: 100000000,
              tokens_burst: 10000000, max_concurrency: 10000}}
  - name: jobs
    class: batch
    api_key_sha256: ["{_key_hash('sk-jobs')}"]
    limits: {{requests_per_s: 1000, requests_burst: 2000, tokens_per_min: 100000000,
              tokens_burst: 10000000, max_concurrency: 10000}}
models:
  - name: {MODEL}
"""


def mixed_factory(interactive_share: float, max_tokens: int) -> Callable[[int, random.Random], RequestSpec]:
    def factory(index: int, rng: random.Random) -> RequestSpec:
        interactive = rng.random() < interactive_share
        tag, key = ("interactive", "sk-web") if interactive else ("batch", "sk-jobs")
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"{PROMPT} ({index})"}]}
        return RequestSpec(tag, body, {"authorization": f"Bearer {key}"})
    return factory


def overload_summary(result: LoadResult) -> dict[str, Any]:
    by_tag: dict[str, list[RequestRecord]] = {"interactive": [], "batch": []}
    for record in result.records:
        by_tag.setdefault(record.tag, []).append(record)
    interactive = by_tag["interactive"]
    # At the door (admission) versus shed from the queue at its deadline: the
    # first must be fast; the second waited, by design, as long as it could.
    shed = [r for r in result.records if r.error_detail == "deadline_exceeded"]
    refused = [r for r in result.records
               if r.status in (429, 503) and r.error_detail != "deadline_exceeded"]
    served = [r.ttft_s for r in interactive if r.ok and r.ttft_s is not None]
    return {
        "requests": len(result.records),
        "interactive_requests": len(interactive),
        "interactive_slo_attainment": round(fraction_at_most(
            [r.ttft_s if r.ok else None for r in interactive], OVERLOAD_SLO_S["interactive"]), 4),
        "batch_completed": sum(1 for r in by_tag["batch"] if r.ok),
        "shed_fraction": round((len(refused) + len(shed)) / max(1, len(result.records)), 4),
        "shed_p99_ms": _p([r.e2e_s for r in refused if r.e2e_s is not None], 99),
        "shed_p50_ms": _p([r.e2e_s for r in refused if r.e2e_s is not None], 50),
        "refused_at_door": len(refused),
        "shed_at_deadline": len(shed),
        "ttft_p50_ms": _p(served, 50),
        "ttft_p99_ms": _p(served, 99),
        "batch_ttft_p50_ms": _p([r.ttft_s for r in by_tag["batch"]
                                 if r.ok and r.ttft_s is not None], 50),
        "other_errors": sum(1 for r in result.records
                            if not r.ok and r.status not in (429, 503)),
    }


def overload(quick: bool, workdir: Path) -> dict[str, Any]:
    # Capacity: 2 workers x 2 slots; a request is ~50 prompt tokens x 1 ms +
    # 10 tokens x 20 ms = ~0.25 s, so ~16 requests/s. Offered: 2x that.
    workers = [SimWorker(f"sim-{i}", 2, 1.0, 20.0, jitter=0.1, seed=i) for i in range(2)]
    rate, duration = 32.0, 20.0 if quick else 60.0
    results: dict[str, Any] = {"offered_rps": rate, "duration_s": duration}
    for mode in ("edf", "fifo"):
        with running_stack(workdir / f"overload-{mode}", overload_policy(mode), workers) as stack:
            result = measure(stack, rate, duration, mixed_factory(0.3, 10), seed=11)
        write_plots(result, workdir / f"overload-{mode}")
        results[mode] = overload_summary(result)
    return results


# -- stragglers -----------------------------------------------------------------


def stragglers_policy(hedge: bool) -> str:
    return f"""
scheduling: {{max_queue: 20000, slo_admission: false, order: edf, prefill_ms_per_token: 1.0}}
timeouts: {{connect_ms: 2000, ttft_ms: 60000, idle_ms: 60000}}
hedging:
  enabled: {str(hedge).lower()}
  quantile: 0.97
  floor_ms: 20
  ceiling_ms: 2000
  min_samples: 20
  budget_ratio: 0.05
  budget_burst: 1
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 60000, hedge: true}}
tenants:
  - name: local
    class: interactive
    limits: {{requests_per_s: 1000, requests_burst: 2000, tokens_per_min: 100000000,
              tokens_burst: 10000000, max_concurrency: 10000}}
models:
  - name: {MODEL}
"""


def single_factory(max_tokens: int) -> Callable[[int, random.Random], RequestSpec]:
    def factory(index: int, rng: random.Random) -> RequestSpec:
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"{PROMPT} ({index})"}]}
        return RequestSpec("interactive", body)
    return factory


def stragglers(quick: bool, workdir: Path) -> dict[str, Any]:
    # 3 workers x 2 slots, ~0.15 s a request: ~40 requests/s of capacity; run at ~30%.
    workers = [SimWorker(f"sim-{i}", 2, 1.0, 10.0, jitter=0.1, straggler_prob=0.02,
                         straggler_factor=10.0, seed=100 + i) for i in range(3)]
    rate, duration = 12.0, 40.0 if quick else 120.0
    results: dict[str, Any] = {"offered_rps": rate, "duration_s": duration}
    for mode, hedge in (("hedge_on", True), ("hedge_off", False)):
        with running_stack(workdir / f"stragglers-{mode}", stragglers_policy(hedge),
                           workers) as stack:
            before = worker_generations(stack)
            result = measure(stack, rate, duration, single_factory(10), seed=23)
            extra = worker_generations(stack) - before - len(result.records)
        write_plots(result, workdir / f"stragglers-{mode}")
        ttfts = [r.ttft_s for r in result.records if r.ok and r.ttft_s is not None]
        hedged = sum(1 for r in result.records if r.headers.get("x-hedgerow-hedged") == "1")
        results[mode] = {
            "requests": len(result.records),
            "ok": sum(1 for r in result.records if r.ok),
            "ttft_p50_ms": _p(ttfts, 50),
            "ttft_p99_ms": _p(ttfts, 99),
            "ttft_p999_ms": _p(ttfts, 99.9),
            "extra_request_fraction": round(max(0, extra) / max(1, len(result.records)), 4),
            "hedge_wins": hedged,
        }
    return results


def throughput(quick: bool, workdir: Path) -> dict[str, Any]:
    """Cache-hit requests/s, Hedgerow vs bare Hypercorn (``bench.throughput``); needs h2load."""
    from bench.throughput import throughput as run

    return run(quick, workdir)


def worker(quick: bool, workdir: Path) -> dict[str, Any]:
    """Prompt reuse, prompt-lookup decoding, warm start, tiers on the real model (``bench.worker_scenario``)."""
    from bench.worker_scenario import worker as run  # loads llama.cpp: only when asked for

    return run(quick, workdir)


def pops(quick: bool, workdir: Path) -> dict[str, Any]:
    """Two PoPs over an emulated WAN (``bench.pops.scenario``); needs root for ``ip netns``."""
    from bench.pops.scenario import pops as run

    return run(quick, workdir)


def cache(quick: bool, workdir: Path) -> dict[str, Any]:
    """Cache hit/miss latency and semantic accuracy (``bench.cache_scenario``)."""
    from bench.cache_scenario import cache as run  # loads MiniLM: only when asked for

    return run(quick, workdir)


def attacks(quick: bool, workdir: Path) -> dict[str, Any]:
    """Known floods: time until the abuser is cut, and a good client's latency (``bench.attacks``)."""
    from bench.attacks import attacks as run

    return run(quick, workdir)


def memory(quick: bool, workdir: Path) -> dict[str, Any]:
    """Resident memory of the gateway's process tree by cache setting (``bench.memory``)."""
    from bench.memory import memory as run

    return run(quick, workdir)


def soak(quick: bool, workdir: Path, duration_s: float | None = None) -> dict[str, Any]:
    """Mixed traffic with worker faults, watching RSS and tasks (``bench.soak``); not in CI."""
    from bench.soak import soak as run

    return run(quick, workdir, duration_s)


SCENARIOS: dict[str, Callable[[bool, Path], dict[str, Any]]] = {
    "overhead": overhead,
    "internal-tls": internal_tls,
    "overload": overload,
    "stragglers": stragglers,
    "throughput": throughput,
    "worker": worker,
    "pops": pops,
    "cache": cache,
    "soak": soak,
    "attacks": attacks,
    "memory": memory,
}


def run_scenario(name: str, quick: bool, workdir: Path | None = None,
                 duration_s: float | None = None) -> dict[str, Any]:
    if name not in SCENARIOS:
        raise SystemExit(f"hedgerow bench: unknown scenario {name!r}; "
                         f"choose from {', '.join(sorted(SCENARIOS))}")
    if duration_s is not None:
        if name != "soak":
            raise SystemExit("hedgerow bench: --duration applies to the soak scenario only")
        return soak(quick, workdir or Path(tempfile.mkdtemp(prefix="hedgerow-bench-soak-")),
                    duration_s)
    if workdir is not None:
        return SCENARIOS[name](quick, workdir)
    with tempfile.TemporaryDirectory(prefix=f"hedgerow-bench-{name}-") as tmp:
        return SCENARIOS[name](quick, Path(tmp))
