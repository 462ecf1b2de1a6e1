"""Scenario ``overhead``: what Hedgerow adds to a request, next to nginx and to nothing.

One simulated worker with a fixed latency (no jitter) is measured three ways
in the same run: ``direct`` (the worker's own URL, mutual TLS as the cluster's
admin, HTTP/1.1), ``hedgerow`` (through the gateway, TLS; the gateway reaches
the worker over mutual TLS, as deployed) and ``nginx`` (through nginx, TLS,
configured by ``bench.nginx``; TLS to the worker too, presenting the admin
credential, so both proxies pay the same hop). Each concurrency level (closed loop: N streams
back to back) runs in rounds, and every round measures all three targets one
after another, rotating which goes first, so drift on this shared machine
hits all three alike. Before each measured run, an unmeasured warm-up of one
request per stream (re)opens the connections: the servers close idle ones
after different keep-alive timeouts, and a reconnect's handshake is not what
is being compared.

Two answer lengths are measured: the short case (``max_tokens``, 8 tokens:
what a request costs) and, when the plan has ``long_levels``, a long-answer
case (``long_tokens``, 256: what each relayed token costs). Per-token CPU is
the difference between the two cases' CPU per request, divided by the
difference in tokens, so the per-request part cancels out.

Two more targets serve the same stream themselves, for CPU only: the worker
(measured while it is ``direct``) and ``floor`` (``bench.floor_server``: the
gateway's own listener -- uvloop, TLS, the capped accept loop, HTTP/1.1 by
``hedgerow.h1`` -- answering with a fixed worker-shaped stream and no
corridor at all). Their CPU per request and per token (``worker_*``,
``floor_*``) is what the HTTP server and TLS cost in Python before any
proxying; Hedgerow minus floor is what the corridor and the upstream hop add.

The shipped gateway serves HTTP/1.1 with ``hedgerow.h1``; the same run also
measures a second gateway and a second floor with ``--http1 hypercorn``
(hypercorn's h11 path, the only one before 2026-12-03): ``hedgerow_hypercorn``
and ``floor_hypercorn``, so the change is shown against what it replaced.

Reported: TTFT p50/p99 per target at the highest concurrency (and per level
under ``by_streams``), each proxy's added latency (target minus direct), the
CPU each proxy's processes spent per request from the kernel's accounting
(``bench.procstat``: utime + stime deltas over the measured rounds only), the
load generator's own CPU per request for each target (``client_cpu_ms_per_request``:
when it nears the machine's capacity, the client is part of what is measured),
and the gateway's resident memory.

The client speaks HTTP/1.1 to every target by default: on this 2-core machine
httpx's HTTP/2 client itself adds hundreds of milliseconds at 100 streams,
which would swamp what is being measured. ``HEDGEROW_BENCH_HTTP=2`` uses
HTTP/2 for the two TLS proxies; the output's ``client_http`` says which.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from bench.loadgen import (ClosedLoop, HttpClients, RequestSpec, Target, http_version_from_env,
                           run_load)
from bench.floor_server import start_floor_server
from bench.nginx import nginx_binary, start_nginx
from bench.procstat import cpu_seconds, own_cpu_seconds, rss_mb
from bench.records import RequestRecord
from bench.stack import Stack
from bench.stats import percentile, tally

MODEL = "smollm2-135m-instruct"
TARGETS: tuple[str, ...] = ("direct", "hedgerow", "hedgerow_hypercorn", "nginx", "floor",
                             "floor_hypercorn")
# ``hedgerow``: the gateway as shipped (HTTP/1.1 by ``hedgerow.h1``); ``hedgerow_hypercorn``:
# a second gateway on the same worker with ``--http1 hypercorn`` (h11), as before 2026-12-03.
PROXIES: tuple[str, ...] = ("hedgerow", "hedgerow_hypercorn", "nginx")
# Targets that serve the stream themselves, and the name their CPU is reported under.
SERVERS: dict[str, str] = {"direct": "worker", "floor": "floor",
                           "floor_hypercorn": "floor_hypercorn"}
PROMPT = "Repeat after me: the hedge is green and tall."


@dataclass(frozen=True)
class OverheadPlan:
    """How much to measure: per concurrency level, requests per target per round."""

    rounds: int
    levels: tuple[tuple[int, int], ...]  # (concurrent streams, requests per target per round)
    max_tokens: int = 8
    prefill_ms_per_token: float = 0.2
    decode_ms_per_token: float = 2.0
    # The long-answer case (none: not measured), same shape as ``levels``.
    long_levels: tuple[tuple[int, int], ...] = ()
    long_tokens: int = 256

    @property
    def top_concurrency(self) -> int:
        return max(concurrency for concurrency, _ in self.levels + self.long_levels)


QUICK = OverheadPlan(rounds=3, levels=((1, 40), (100, 800)), long_levels=((1, 8), (100, 100)))
FULL = OverheadPlan(rounds=6, levels=((1, 100), (100, 2000)),
                    long_levels=((1, 20), (100, 500)))


def overhead_policy() -> str:
    """Anonymous traffic, limits far above the load, no hedging: only the gateway's path."""
    return f"""
scheduling: {{max_queue: 20000, slo_admission: false, order: edf, prefill_ms_per_token: 0.2}}
timeouts: {{connect_ms: 2000, ttft_ms: 60000, idle_ms: 60000}}
hedging: {{enabled: false}}
# Every prompt is unique; no embedding model loaded (RSS is measured without it).
cache: {{semantic: {{enabled: false}}}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 60000, hedge: false}}
tenants:
  - name: local
    class: interactive
    limits: {{requests_per_s: 100000, requests_burst: 100000, tokens_per_min: 1000000000,
              tokens_burst: 100000000, max_concurrency: 100000}}
models:
  - name: {MODEL}
"""


@dataclass
class Measured:
    """One target at one concurrency level, summed over the rounds."""

    records: list[RequestRecord] = field(default_factory=list)
    cpu_s: float = 0.0  # the proxy's processes (none for direct)
    client_cpu_s: float = 0.0  # this process: the load generator
    started_at_s: list[float] = field(default_factory=list)  # each record's send, since the scenario began


def overhead(quick: bool, workdir: Path) -> dict[str, Any]:
    return measure_overhead(workdir, QUICK if quick else FULL)


def measure_overhead(workdir: Path, plan: OverheadPlan) -> dict[str, Any]:
    """Start worker, gateway and nginx under ``workdir``, measure ``plan``, summarise."""
    nginx_binary()  # fail before starting anything if nginx is missing
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "policy.yaml").write_text(overhead_policy())
    stack = Stack(workdir)
    try:
        stack.start_control_plane()
        worker_url, worker_pid = _start_fixed_worker(stack, plan)
        gateway = stack.start_gateway("--policy", str(workdir / "policy.yaml"))
        gateway_url = stack.gateway_url
        hypercorn_gateway = stack.start_gateway("--policy", str(workdir / "policy.yaml"),
                                                "--http1", "hypercorn")
        hypercorn_gateway_url = stack.gateway_url
        tls_dir = workdir / "state" / "tls"
        upstream_tls = None if stack.insecure else stack.admin_identity
        nginx, nginx_url = start_nginx(workdir / "nginx", worker_url.split("://", 1)[1],
                                       tls_dir / "cert.pem", tls_dir / "key.pem",
                                       upstream_tls=upstream_tls)
        stack.procs.append(nginx)
        floor, floor_url = start_floor_server(
            workdir / "floor", tls_dir / "cert.pem", tls_dir / "key.pem",
            prefill_ms=plan.prefill_ms_per_token * 13,  # the prompts' ~13 tokens
            decode_ms=plan.decode_ms_per_token, http1="native")
        stack.procs.append(floor)
        floor_hypercorn, floor_hypercorn_url = start_floor_server(
            workdir / "floor", tls_dir / "cert.pem", tls_dir / "key.pem",
            prefill_ms=plan.prefill_ms_per_token * 13, decode_ms=plan.decode_ms_per_token,
            http1="hypercorn")
        stack.procs.append(floor_hypercorn)
        http = http_version_from_env()
        direct = Target(worker_url, request_timeout_s=120.0,
                        ca_file=None if stack.insecure else stack.cluster_ca,
                        client_identity=upstream_tls, check_hostname=False)
        targets = {"direct": direct,
                   "hedgerow": Target(gateway_url, http, stack.ca_cert, request_timeout_s=120.0),
                   "hedgerow_hypercorn": Target(hypercorn_gateway_url, http, stack.ca_cert,
                                             request_timeout_s=120.0),
                   "nginx": Target(nginx_url, http, stack.ca_cert, request_timeout_s=120.0),
                   "floor": Target(floor_url, http, stack.ca_cert, request_timeout_s=120.0),
                   "floor_hypercorn": Target(floor_hypercorn_url, http, stack.ca_cert,
                                          request_timeout_s=120.0)}
        # The worker's own CPU while it is measured directly: what serving the same
        # stream with hypercorn and TLS costs in Python, with no proxying at all.
        pids = {"direct": worker_pid, "hedgerow": gateway.popen.pid,
                "hedgerow_hypercorn": hypercorn_gateway.popen.pid, "nginx": nginx.popen.pid,
                "floor": floor.popen.pid, "floor_hypercorn": floor_hypercorn.popen.pid}
        measured, long = anyio.run(_measure_all, targets, pids, plan)
        summary = summarize_overhead(measured, plan, http)
        if long:
            summary["long_answer"] = summarize_long(measured, long, plan)
        summary["hedgerow_rss_mb"] = round(rss_mb(gateway.popen.pid), 1)
        summary["hedgerow_hypercorn_rss_mb"] = round(rss_mb(hypercorn_gateway.popen.pid), 1)
    finally:
        stack.stop_all()
    from bench.plots import write_latency_plots  # matplotlib: loaded only when a scenario runs

    write_latency_plots(workdir, _plot_groups(measured), title="overhead: TTFT", metric="TTFT")
    if long:
        write_latency_plots(workdir / "long", _plot_groups(long),
                            title=f"overhead, {plan.long_tokens}-token answers: TTFT",
                            metric="TTFT")
    return summary


def _start_fixed_worker(stack: Stack, plan: OverheadPlan) -> tuple[str, int]:
    """The simulated worker's URL and process id."""
    slots = 2 * plan.top_concurrency + 8  # never queue inside the worker
    proc = stack.start_worker("sim-fixed", "--backend", "sim", "--slots", str(slots),
                       "--sim-prefill-ms-per-token", str(plan.prefill_ms_per_token),
                       "--sim-decode-ms-per-token", str(plan.decode_ms_per_token),
                       "--sim-jitter", "0", "--sim-seed", "1")
    record = stack.worker("sim-fixed")
    assert record is not None, "the worker registered but is not listed"
    return str(record["registration"]["url"]).rstrip("/"), proc.popen.pid


def unique_prompt_factory(max_tokens: int) -> Callable[[int, random.Random], RequestSpec]:
    """Streaming chats whose prompts never repeat (so no cache can answer one)."""
    serial = itertools.count()

    def factory(index: int, rng: random.Random) -> RequestSpec:
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"{PROMPT} #{next(serial):07d}"}]}
        return RequestSpec("chat", body)
    return factory


MeasuredByLevel = dict[int, dict[str, Measured]]


async def _measure_all(targets: Mapping[str, Target], pids: Mapping[str, int],
                       plan: OverheadPlan) -> tuple[MeasuredByLevel, MeasuredByLevel]:
    """(the short case, the long-answer case: empty when the plan has none)."""
    began = anyio.current_time()
    async with AsyncExitStack() as exits:
        clients = {name: await exits.enter_async_context(HttpClients(target))
                   for name, target in targets.items()}
        short = await _measure_case(targets, clients, pids, plan.rounds, plan.levels,
                                    plan.max_tokens, began)
        long = await _measure_case(targets, clients, pids, plan.rounds, plan.long_levels,
                                   plan.long_tokens, began)
    return short, long


async def _measure_case(targets: Mapping[str, Target], clients: Mapping[str, HttpClients],
                        pids: Mapping[str, int], rounds: int,
                        levels: tuple[tuple[int, int], ...], max_tokens: int,
                        began: float) -> MeasuredByLevel:
    factory = unique_prompt_factory(max_tokens)
    measured: MeasuredByLevel = {}
    for concurrency, per_round in levels:
        level = measured[concurrency] = {name: Measured() for name in targets}
        for round_index in range(rounds):
            for name in _rotated(list(targets), round_index):
                # Unmeasured warm-up: servers close idle keep-alive connections at
                # different times (Hypercorn after 5 s), so reopen them all first.
                await run_load(targets[name], ClosedLoop(concurrency, count=concurrency),
                               factory, clients=clients[name])
                pid = pids.get(name)
                cpu_before = cpu_seconds(pid) if pid else 0.0
                client_before = own_cpu_seconds(os.getpid())
                offset = anyio.current_time() - began
                result = await run_load(targets[name], ClosedLoop(concurrency, count=per_round),
                                        factory, seed=round_index, clients=clients[name])
                level[name].cpu_s += (cpu_seconds(pid) - cpu_before) if pid else 0.0
                level[name].client_cpu_s += own_cpu_seconds(os.getpid()) - client_before
                level[name].records.extend(result.records)
                level[name].started_at_s.extend(offset + r.intended_s for r in result.records)
    return measured


def _rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def summarize_overhead(measured: MeasuredByLevel, plan: OverheadPlan,
                       client_http: str) -> dict[str, Any]:
    """The scenario's JSON: the top level at the highest concurrency, every level under ``by_streams``."""
    by_streams = {str(concurrency): summarize_level(level) for concurrency, level in measured.items()}
    top = by_streams[str(plan.top_concurrency)]
    proxies = [proxy for proxy in PROXIES if all(proxy in level for level in measured.values())]
    cpu = {proxy: sum(level[proxy].cpu_s for level in measured.values()) for proxy in proxies}
    requests = {proxy: sum(len(level[proxy].records) for level in measured.values())
                for proxy in proxies}
    return {
        **top,
        "baseline": "nginx (a stock reverse proxy, its recommended streaming settings); "
                    "direct to the worker for the added latency",
        "streams": plan.top_concurrency,
        "by_streams": by_streams,
        **{f"{proxy}_cpu_ms_per_request": round(1000 * cpu[proxy] / max(1, requests[proxy]), 3)
           for proxy in proxies},
        "client_http": client_http,
        "rounds": plan.rounds,
        "worker_latency": {"prefill_ms_per_token": plan.prefill_ms_per_token,
                           "decode_ms_per_token": plan.decode_ms_per_token,
                           "max_tokens": plan.max_tokens, "jitter": 0},
    }


def summarize_level(level: Mapping[str, Measured]) -> dict[str, Any]:
    """Per-target TTFT percentiles and each proxy's added latency, for one concurrency level."""
    per_target = {name: _target_summary(m) for name, m in level.items()}
    summary: dict[str, Any] = dict(per_target)
    direct = per_target["direct"]
    for proxy in (proxy for proxy in PROXIES if proxy in level):
        for q in ("p50", "p99"):
            summary[f"{proxy}_added_{q}_ms"] = _difference(per_target[proxy][f"ttft_{q}_ms"],
                                                           direct[f"ttft_{q}_ms"])
        requests = len(level[proxy].records)
        summary[f"{proxy}_cpu_ms_per_request"] = round(1000 * level[proxy].cpu_s / max(1, requests), 3)
    # What serving the stream costs with no proxying at all: the worker (hypercorn,
    # TLS, its simulated generation) and the floor server (the gateway's own
    # listener, no corridor: ``bench.floor_server``).
    for target, name in SERVERS.items():
        if target in level:
            summary[f"{name}_cpu_ms_per_request"] = round(
                1000 * level[target].cpu_s / max(1, len(level[target].records)), 3)
    return summary


def summarize_long(short: MeasuredByLevel, long: MeasuredByLevel,
                   plan: OverheadPlan) -> dict[str, Any]:
    """The long-answer case, and each proxy's CPU per relayed token next to nginx's.

    Per token: (CPU per long request - CPU per short request) / (token difference)
    at the same concurrency, so the per-request part cancels out.
    """
    by_streams = {str(c): summarize_level(level) for c, level in long.items()}
    extra_tokens = plan.long_tokens - plan.max_tokens
    side_by_side: dict[str, Any] = {}
    for concurrency in sorted(long):
        row: dict[str, Any] = {}
        short_level = summarize_level(short[concurrency]) if concurrency in short else None
        for proxy in (proxy for proxy in PROXIES if proxy in long[concurrency]):
            key = f"{proxy}_cpu_ms_per_request"
            row[f"{proxy}_cpu_ms_per_long_request"] = by_streams[str(concurrency)][key]
            if short_level is not None:
                row[f"{proxy}_cpu_ms_per_request"] = short_level[key]
                row[f"{proxy}_cpu_us_per_token"] = round(
                    1000 * (by_streams[str(concurrency)][key] - short_level[key])
                    / max(1, extra_tokens), 3)
                for q in ("p50", "p99"):
                    row[f"{proxy}_added_{q}_ms"] = short_level[f"{proxy}_added_{q}_ms"]
        if short_level is not None:
            for name in SERVERS.values():
                key = f"{name}_cpu_ms_per_request"
                if key not in short_level or key not in by_streams[str(concurrency)]:
                    continue
                row[key] = short_level[key]
                row[f"{name}_cpu_us_per_token"] = round(
                    1000 * (by_streams[str(concurrency)][key] - short_level[key])
                    / max(1, extra_tokens), 3)
                row[f"{name}_cpu_per_request_vs_nginx"] = _ratio(
                    row[key], row["nginx_cpu_ms_per_request"])
                row[f"{name}_cpu_per_token_vs_nginx"] = _ratio(
                    row[f"{name}_cpu_us_per_token"], row["nginx_cpu_us_per_token"])
            row["cpu_per_request_vs_nginx"] = _ratio(row["hedgerow_cpu_ms_per_request"],
                                                     row["nginx_cpu_ms_per_request"])
            row["cpu_per_token_vs_nginx"] = _ratio(row["hedgerow_cpu_us_per_token"],
                                                   row["nginx_cpu_us_per_token"])
            if "hedgerow_hypercorn_cpu_ms_per_request" in row:
                row["hedgerow_hypercorn_cpu_per_request_vs_nginx"] = _ratio(
                    row["hedgerow_hypercorn_cpu_ms_per_request"], row["nginx_cpu_ms_per_request"])
                row["hedgerow_hypercorn_cpu_per_token_vs_nginx"] = _ratio(
                    row["hedgerow_hypercorn_cpu_us_per_token"], row["nginx_cpu_us_per_token"])
        side_by_side[str(concurrency)] = row
    return {"baseline": "nginx, same run", "max_tokens": plan.long_tokens,
            "by_streams": by_streams, "side_by_side": side_by_side}


def _ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None or baseline <= 0:
        return None
    return round(value / baseline, 2)


def _target_summary(measured: Measured) -> dict[str, Any]:
    ttfts = sorted(r.ttft_s for r in measured.records if r.ok and r.ttft_s is not None)
    failed = [r for r in measured.records if not r.ok]
    return {
        "requests": len(measured.records),
        "ok": len(measured.records) - len(failed),
        "errors": len(failed),
        "error_kinds": tally(f"{r.error}:{r.error_detail}" for r in failed),
        "client_cpu_ms_per_request": round(1000 * measured.client_cpu_s
                                           / max(1, len(measured.records)), 3),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)) if ttfts else None,
        "ttft_p99_ms": _ms(percentile(ttfts, 99)) if ttfts else None,
    }


def _difference(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or baseline is None else round(value - baseline, 3)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _plot_groups(measured: MeasuredByLevel) -> dict[str, list[tuple[float, float]]]:
    return {f"{name} @{concurrency}": [(at, r.ttft_s) for at, r in zip(m.started_at_s, m.records)
                                       if r.ok and r.ttft_s is not None]
            for concurrency, level in measured.items() for name, m in level.items()}
