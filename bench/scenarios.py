"""Benchmark scenarios: each starts what it needs here and prints one JSON line.

``overload``    mixed interactive/batch traffic at about twice capacity: EDF +
                admission against FIFO + the same admission (the baseline),
                in alternating rounds, then plain FIFO with no admission.
                Shows SLO attainment, what was shed and how fast.
``overhead``    a fixed-latency worker measured directly, through Hedgerow
                and through nginx in interleaved rounds (see ``bench.overhead``).
``internal-tls`` the same gateway and worker with internal mutual TLS and with
                ``--insecure-internal``, interleaved: what mTLS costs per request
                (see ``bench.internal_tls``).
``throughput``  exact cache hits over HTTP/2 through Hedgerow vs a bare
                Hypercorn hello-world app, interleaved, with h2load
                (see ``bench.throughput``).
``stragglers``  hedging at the shipped settings on and off (two classes of
                one gateway, requests interleaved), with 2% of requests ten
                times slower (independent) and with workers slow for seconds
                at a time (correlated, ``--sim-slow-periods``). Shows TTFT
                percentiles and the extra worker requests hedging cost.
``worker``      the real bundled model in-process (``bench.worker_scenario``):
                prompt reuse across turns, prompt-lookup decoding, warm
                start and quantization tiers.
``pops``        two PoPs in network namespaces over an emulated WAN
                (``bench.pops``): local-first versus local-only (the baseline)
                and locality-blind routing, and one PoP's workers all killed,
                with and without spilling. Needs root (``ip netns``).
``cache``       response-cache hit and miss latency through the gateway, and how many
                seeded paraphrases the shipped judge hits (``bench.cache_scenario``;
                the judge's precision and recall: ``bench.pair_eval``).
``attacks``     HTTP/2 floods (rapid reset, the 2019 family), a QUIC Initial flood and a
                per-IP TCP connection flood: per attack, time until the abuser is cut
                or contained, what it got through, and a good client's p50/p99
                before and during it (``bench.attacks``).
``memory``      resident memory of everything a gateway starts with the shipped
                policy (semantic cache off), with the semantic cache on (its
                embedding sidecar included) and cache off (``bench.memory``).
``soak``        mixed traffic with worker kills and freezes for ``--duration``
                seconds; RSS over time, errors by kind, tasks left (``bench.soak``).

The others run simulated workers (a latency model, ``--backend sim``). ``overload``
and ``stragglers`` measure the gateway's scheduling with open-loop Poisson
load whose latencies count from the intended send time. Every scenario's JSON names
the baseline it was measured against (``"baseline"``). Each scenario writes
PNG plots (latency CDFs, latency over time) next to its process logs in the
working directory (``--workdir`` keeps them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import time
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

import policies as policies_package

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
    slow_periods: str | None = None  # PROB:SECONDS:FACTOR, correlated stragglers

    def args(self) -> list[str]:
        slow = ["--sim-slow-periods", self.slow_periods] if self.slow_periods else []
        return [*slow, "--backend", "sim", "--slots", str(self.slots),
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


@contextmanager
def running_stacks(root: Path, policies: dict[str, str],
                   workers: list[SimWorker]) -> Iterator[dict[str, Stack]]:
    """One stack per named policy, all running at once, for side-by-side measurement."""
    with ExitStack() as stacks:
        yield {name: stacks.enter_context(running_stack(root / name, policy, workers))
               for name, policy in policies.items()}


def joined(results: list[LoadResult]) -> LoadResult:
    """Rounds of one variant as one result (records renumbered in order)."""
    records: list[RequestRecord] = []
    for result in results:
        records += [dataclasses.replace(r, index=len(records) + k)
                    for k, r in enumerate(result.records)]
    return LoadResult(records=records, wall_s=sum(r.wall_s for r in results),
                      load=results[0].load if results else {})


def machine_load() -> float:
    """The 1-minute load average: these machines are shared, so every run records it."""
    return round(os.getloadavg()[0], 2)


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

OVERLOAD_SLO_S = {"interactive": 1.0, "batch": 10.0}


def overload_policy(mode: str) -> str:
    """``edf``: EDF + admission; ``fifo_admission``: FIFO + the same admission; ``fifo``: neither."""
    if mode not in OVERLOAD_BASELINES:
        raise ValueError(f"unknown overload mode {mode!r}")
    admission = mode != "fifo"
    return f"""
scheduling:
  max_queue: 20000
  slo_admission: {str(admission).lower()}
  order: {"edf" if mode == "edf" else "fifo"}
  prefill_ms_per_token: 1.0
timeouts: {{connect_ms: 2000, ttft_ms: 120000, idle_ms: 60000}}
hedging: {{enabled: false}}
cache: {{enabled: false}}  # not the subject; no embedding sidecar competing for the cores
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 800, hedge: false}}
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


@dataclass(frozen=True)
class OverloadPlan:
    rate: float = 8.0
    duration_s: float = 20.0  # per variant, over all rounds
    rounds: int = 4  # the pair alternates ABBA..., one stack loaded at a time
    # Also run FIFO without admission (alone, after the pair): the weak baseline
    # that shows what admission alone buys.
    with_fifo_alone: bool = True


OVERLOAD_BASELINES = {
    "edf": "EDF queue + SLO admission + deadline shedding (Hedgerow's shipped scheduling)",
    "fifo_admission": "FIFO queue + the same SLO admission (the strongest honest baseline: "
                      "what a gateway with admission control but no deadline ordering does)",
    "fifo": "FIFO queue, no admission, no shedding (a plain proxy in front of the workers)",
}


def overload_workers() -> list[SimWorker]:
    # Capacity: 2 workers x 2 slots; a request is ~55 prompt tokens x 1 ms +
    # 10 tokens x 90 ms = ~0.95 s, so ~4.2 requests/s. Offered: about 2x that.
    # (Until 2026-12-01: 20 ms a token at 32 requests/s; on this shared machine at
    # load ~9 the gateway and load generator then queued for CPU for seconds,
    # door refusals included, so the run measured the machine, not the queue.)
    return [SimWorker(f"sim-{i}", 2, 1.0, 90.0, jitter=0.1, seed=i) for i in range(2)]


def overload(quick: bool, workdir: Path) -> dict[str, Any]:
    return measure_overload(workdir, OverloadPlan(duration_s=20.0 if quick else 60.0))


def measure_overload(workdir: Path, plan: OverloadPlan) -> dict[str, Any]:
    """EDF + admission and FIFO + the same admission, both stacks up, measured in
    alternating rounds (ABBA, the same arrivals in each round's pair) so drift on a
    shared machine hits both alike while only one is loaded at a time (two at once
    saturate two cores); then, if asked, FIFO with no admission alone."""
    results: dict[str, Any] = {
        "baseline": "fifo+admission", "baselines": OVERLOAD_BASELINES,
        "offered_rps": plan.rate, "duration_s": plan.duration_s,
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "load_avg_1m_before": machine_load()}
    pair = {"edf": overload_policy("edf"), "fifo_admission": overload_policy("fifo_admission")}
    round_s = plan.duration_s / plan.rounds
    rounds: dict[str, list[LoadResult]] = {mode: [] for mode in pair}
    with running_stacks(workdir / "overload", pair, overload_workers()) as stacks:
        for n in range(plan.rounds):
            order = list(pair) if n % 4 in (0, 3) else list(pair)[::-1]
            for mode in order:
                rounds[mode].append(measure(stacks[mode], plan.rate, round_s,
                                            mixed_factory(0.3, 10), seed=11 + n))
    measured = {mode: joined(results) for mode, results in rounds.items()}
    results["rounds"] = plan.rounds
    for mode, result in measured.items():
        write_plots(result, workdir / "overload" / mode)
        results[mode] = overload_summary(result)
    if plan.with_fifo_alone:
        with running_stack(workdir / "overload-fifo", overload_policy("fifo"),
                           overload_workers()) as stack:
            result = measure(stack, plan.rate, plan.duration_s, mixed_factory(0.3, 10), seed=11)
        write_plots(result, workdir / "overload-fifo")
        results["fifo"] = overload_summary(result)
    edf, base = (results[m]["interactive_slo_attainment"] for m in ("edf", "fifo_admission"))
    results["attainment_edf_minus_baseline"] = round(edf - base, 4)
    results["load_avg_1m_after"] = machine_load()
    return results


# -- stragglers -----------------------------------------------------------------


def shipped_hedging() -> dict[str, Any]:
    """The hedging section of the shipped policy (``policies/default.yaml``), as a user gets it."""
    import yaml

    shipped = yaml.safe_load((Path(policies_package.__file__).parent / "default.yaml").read_text())
    return dict(shipped["hedging"])


HEDGE_MODES = ("hedge_on", "hedge_off")


def stragglers_policy(hedging_enabled: bool = True) -> str:
    """One gateway, two classes alike but for ``hedge``: requests of both run
    interleaved on the same workers at the same moments. The hedge budget is
    earned per request of either class, so its ratio is scaled to the hedged
    share: hedges stay within the shipped 5% of the hedged requests."""
    shipped = shipped_hedging()
    hedging = {**shipped, "enabled": hedging_enabled,
               "budget_ratio": shipped["budget_ratio"] * HEDGED_SHARE}
    return f"""
scheduling: {{max_queue: 20000, slo_admission: false, order: edf, prefill_ms_per_token: 1.0}}
timeouts: {{connect_ms: 2000, ttft_ms: 60000, idle_ms: 60000}}
hedging: {json.dumps(hedging)}
cache: {{enabled: false}}  # not the subject; no embedding sidecar competing for the cores
classes:
  - {{name: hedged, ttft_slo_ms: 1000, deadline_ms: 60000, hedge: true}}
  - {{name: unhedged, ttft_slo_ms: 1000, deadline_ms: 60000, hedge: false}}
tenants:
  - name: hedge_on
    class: hedged
    api_key_sha256: ["{_key_hash('sk-hedge-on')}"]
    limits: {{requests_per_s: 1000, requests_burst: 2000, tokens_per_min: 100000000,
              tokens_burst: 10000000, max_concurrency: 10000}}
  - name: hedge_off
    class: unhedged
    api_key_sha256: ["{_key_hash('sk-hedge-off')}"]
    limits: {{requests_per_s: 1000, requests_burst: 2000, tokens_per_min: 100000000,
              tokens_burst: 10000000, max_concurrency: 10000}}
models:
  - name: {MODEL}
"""


HEDGED_SHARE = 0.5


def hedge_split_factory(max_tokens: int) -> Callable[[int, random.Random], RequestSpec]:
    """Alternate requests between the hedged and the unhedged class."""
    def factory(index: int, rng: random.Random) -> RequestSpec:
        mode = HEDGE_MODES[index % 2]
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"{PROMPT} ({index})"}]}
        key = "sk-hedge-on" if mode == "hedge_on" else "sk-hedge-off"
        return RequestSpec(mode, body, {"authorization": f"Bearer {key}"})
    return factory


@dataclass(frozen=True)
class StragglerPlan:
    rate: float = 12.0  # both classes together
    warm_up_s: float = 10.0  # unmeasured: fills the TTFT sketch and the hedge budget
    duration_s: float = 40.0
    straggler_prob: float = 0.02  # independent: each request on its own
    slow_periods: str = "0.1:3:10"  # correlated: 10% of 3-s windows, per worker, 10x slower
    cases: tuple[str, ...] = ("independent", "correlated")
    hedging_enabled: bool = True  # False: the mechanism switched off (to see a claim fail)


def straggler_workers(case: str, plan: StragglerPlan) -> list[SimWorker]:
    # 3 workers x 2 slots; a request is ~55 prompt tokens x 2 ms (TTFT ~110 ms, a
    # straggler's ~1.1 s: far above this shared machine's CPU noise) + 6 tokens x
    # 10 ms, ~0.17 s: ~35 requests/s of capacity; run at about a third.
    independent = case == "independent"
    return [SimWorker(f"sim-{i}", 2, 2.0, 10.0, jitter=0.1,
                      straggler_prob=plan.straggler_prob if independent else 0.0,
                      straggler_factor=10.0, seed=100 + i,
                      slow_periods=None if independent else plan.slow_periods)
            for i in range(3)]


def stragglers(quick: bool, workdir: Path) -> dict[str, Any]:
    return measure_stragglers(workdir, StragglerPlan(duration_s=40.0 if quick else 120.0))


def measure_stragglers(workdir: Path, plan: StragglerPlan) -> dict[str, Any]:
    """Hedging on and off at the shipped settings, in one gateway on the same workers,
    requests alternating between the two, for independent and correlated stragglers."""
    results: dict[str, Any] = {
        "baseline": "hedging off (a class with hedge: false, same gateway and workers)",
        "hedging_settings": shipped_hedging(),
        "hedge_budget_ratio_in_run": shipped_hedging()["budget_ratio"] * HEDGED_SHARE,
        "offered_rps": plan.rate, "warm_up_s": plan.warm_up_s, "duration_s": plan.duration_s,
        "straggler_prob": plan.straggler_prob, "slow_periods": plan.slow_periods,
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "load_avg_1m_before": machine_load()}
    factory = hedge_split_factory(6)
    for case in plan.cases:
        root = workdir / f"stragglers-{case}"
        with running_stack(root, stragglers_policy(plan.hedging_enabled),
                           straggler_workers(case, plan)) as stack:
            # A gateway that has been up a while: sketch filled, budget saved up.
            measure(stack, plan.rate, plan.warm_up_s, factory, seed=7)
            before = worker_generations(stack)
            result = measure(stack, plan.rate, plan.duration_s, factory, seed=23)
            extra = worker_generations(stack) - before - len(result.records)
        write_plots(result, root)
        out: dict[str, Any] = {}
        for mode in HEDGE_MODES:
            records = [r for r in result.records if r.tag == mode]
            # Every extra generation is a hedge, and only hedged requests hedge.
            out[mode] = straggler_summary(records, extra if mode == "hedge_on" else 0)
        on, off = out["hedge_on"]["ttft_p99_ms"], out["hedge_off"]["ttft_p99_ms"]
        out["p99_cut"] = round(1 - on / off, 3) if on is not None and off else None
        results[case] = out
    results["load_avg_1m_after"] = machine_load()
    return results


def straggler_summary(records: list[RequestRecord], extra: int) -> dict[str, Any]:
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    hedged = sum(1 for r in records if r.headers.get("x-hedgerow-hedged") == "1")
    return {
        "requests": len(records),
        "ok": sum(1 for r in records if r.ok),
        "ttft_p50_ms": _p(ttfts, 50),
        "ttft_p99_ms": _p(ttfts, 99),
        "ttft_p999_ms": _p(ttfts, 99.9),
        "extra_request_fraction": round(max(0, extra) / max(1, len(records)), 4),
        "hedge_wins": hedged,
    }


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
    """Cache hit/miss latency and semantic hits through the gateway (``bench.cache_scenario``)."""
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


def processes(quick: bool, workdir: Path) -> dict[str, Any]:
    """The gateway with --processes 1 and 2: cache hits and streamed misses (``bench.processes``)."""
    from bench.processes import processes as run

    return run(quick, workdir)


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
    "processes": processes,
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
