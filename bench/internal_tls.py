"""Scenario ``internal-tls``: what mutual TLS between gateway and worker costs.

Two stacks run side by side on this machine, identical but for internal
trust: one as shipped (the gateway calls its worker over mutual TLS, checks
the worker's identity, renews its certificate) and one started with
``--insecure-internal`` (plain HTTP between them). Each has a gateway and one
simulated worker with a fixed latency and no jitter. Every round measures both
gateways one after the other, rotating which goes first, with the load
generator, prompts and policy of ``bench.overhead``; connections are warmed
before each measured run, so what is compared is the pooled, steady state
(a handshake is paid once per pooled connection, not per request).

Reported per concurrency level: TTFT p50/p99 through each gateway, the added
TTFT of mutual TLS (mtls minus plain), and each gateway process's CPU per
streamed request (``bench.procstat``: utime + stime over the measured runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from bench.loadgen import Target, http_version_from_env
from bench.overhead import (FULL, QUICK, OverheadPlan, Measured, _measure_all, _start_fixed_worker,
                            _target_summary, overhead_policy)
from bench.stack import Stack

MODES: tuple[str, ...] = ("plain", "mtls")


def internal_tls(quick: bool, workdir: Path) -> dict[str, Any]:
    plan = OverheadPlan(rounds=QUICK.rounds if quick else FULL.rounds,
                        levels=((1, 60), (20, 600)) if quick else ((1, 150), (20, 1500)))
    return measure_internal_tls(workdir, plan)


def measure_internal_tls(workdir: Path, plan: OverheadPlan) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "policy.yaml").write_text(overhead_policy())
    stacks = {"plain": Stack(workdir / "plain", insecure=True), "mtls": Stack(workdir / "mtls")}
    http = http_version_from_env()
    try:
        targets, pids = {}, {}
        for mode, stack in stacks.items():
            stack.root.mkdir(parents=True, exist_ok=True)
            stack.start_control_plane()
            _start_fixed_worker(stack, plan)
            gateway = stack.start_gateway("--policy", str(workdir / "policy.yaml"))
            targets[mode] = Target(stack.gateway_url, http, stack.ca_cert, request_timeout_s=120.0)
            pids[mode] = gateway.popen.pid
        measured, _no_long_case = anyio.run(_measure_all, targets, pids, plan)
    finally:
        for stack in stacks.values():
            stack.stop_all()
    return summarize(measured, plan, http)


def summarize(measured: dict[int, dict[str, Measured]], plan: OverheadPlan,
              client_http: str) -> dict[str, Any]:
    by_streams: dict[str, Any] = {}
    for concurrency, level in measured.items():
        row: dict[str, Any] = {mode: _target_summary(level[mode]) for mode in MODES}
        for mode in MODES:
            row[f"{mode}_gateway_cpu_ms_per_request"] = round(
                1000 * level[mode].cpu_s / max(1, len(level[mode].records)), 3)
        for q in ("p50", "p99"):
            plain, mtls = row["plain"][f"ttft_{q}_ms"], row["mtls"][f"ttft_{q}_ms"]
            row[f"mtls_added_ttft_{q}_ms"] = (None if plain is None or mtls is None
                                              else round(mtls - plain, 3))
        plain_cpu = row["plain_gateway_cpu_ms_per_request"]
        row["mtls_cpu_increase_pct"] = (round(100 * (row["mtls_gateway_cpu_ms_per_request"]
                                                     - plain_cpu) / plain_cpu, 1)
                                        if plain_cpu else None)
        by_streams[str(concurrency)] = row
    return {"baseline": "the same gateway and worker with --insecure-internal (plain HTTP)",
            "by_streams": by_streams, "client_http": client_http, "rounds": plan.rounds,
            "worker_latency": {"prefill_ms_per_token": plan.prefill_ms_per_token,
                               "decode_ms_per_token": plan.decode_ms_per_token,
                               "max_tokens": plan.max_tokens, "jitter": 0}}
