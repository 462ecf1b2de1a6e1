"""A GPU worker next to a CPU worker, each streaming through the same gateway.

``scripts/gpu-check`` runs this on a machine with an NVIDIA GPU once the CUDA
build of llama-cpp-python is importable:

    python3 -m bench.gpu_check --workdir /tmp/gpu-check [--quick] [--only cpu|gpu]

One control plane and one gateway; first a GPU worker (all layers offloaded,
``--gpu-slots`` slots) is registered alone and measured, then it leaves and a
CPU worker (no layers offloaded, CUDA hidden from it) is measured the same
way. Each is driven closed-loop over HTTPS through the gateway, every prompt
unique (so neither a slot's prompt reuse nor a gateway cache turns a
measurement into a cache hit) and the policy set to pass every request
through once (``measurement_policy``), in three cases: one user with a short chat
prompt, one user with a long (prefill-heavy) prompt, and ``--users`` users at
once. Printed: each worker's registration (kind, device, memory) and GPU
memory in use (nvidia-smi), then per case TTFT p50/p95, the per-stream decode
rate (1 / inter-token gap p50) and the aggregate tokens/s; the last line is
the whole result as JSON. A GPU worker that registers as anything but
``gpu`` fails the check (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import yaml

from bench.loadgen import ClosedLoop, RequestSpec, Target, run_load
from bench.stack import Stack, wait_for
from policies.schema import DEFAULT_POLICY_PATH

MODEL = "smollm2-135m-instruct"
LONG_PROMPT_WORDS = 900  # about 1,150 tokens of the bundled model: the prefill dominates the first token
TOPICS = ("foxes", "rivers", "lighthouses", "bread", "trains", "owls", "glaciers", "chess")


@dataclass(frozen=True)
class Case:
    name: str
    users: int
    count: int
    long_prompt: bool


@dataclass(frozen=True)
class WorkerPlan:
    name: str  # "gpu" | "cpu"
    args: tuple[str, ...]
    env: dict[str, str]


def cases(users: int, quick: bool) -> list[Case]:
    scale = 1 if quick else 3
    return [Case("1 user, short prompt", 1, 8 * scale, False),
            Case("1 user, long prompt", 1, 4 * scale, True),
            Case(f"{users} users, short prompt", users, 4 * users * scale, False)]


def worker_plans(gpu_slots: int, cpu_slots: int, only: str | None) -> list[WorkerPlan]:
    plans = [WorkerPlan("gpu", ("--n-gpu-layers", "-1", "--slots", str(gpu_slots)), {}),
             # CUDA hidden: llama.cpp's CUDA build then has no device and computes on the CPU only.
             WorkerPlan("cpu", ("--n-gpu-layers", "0", "--slots", str(cpu_slots)),
                        {"CUDA_VISIBLE_DEVICES": ""})]
    return [plan for plan in plans if only in (None, plan.name)]


def request_factory(max_tokens: int, long_prompt: bool, tag: str) -> Any:
    def factory(index: int, rng: random.Random) -> RequestSpec:
        topic = TOPICS[index % len(TOPICS)]
        # A unique first line: no prefix shared with any earlier request.
        opening = f"Request {index}-{rng.getrandbits(32):08x}."
        if long_prompt:
            words = " ".join(rng.choice(TOPICS) for _ in range(LONG_PROMPT_WORDS))
            text = f"{opening} Here are some notes: {words}\nSummarise the notes about {topic}."
        else:
            text = f"{opening} Write a long story about {topic}."
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0.7,
                "messages": [{"role": "user", "content": text}]}
        return RequestSpec(tag, body, headers={"cache-control": "no-cache"})
    return factory


def measurement_policy(workdir: Path) -> Path:
    """The shipped policy set to measure one worker: every request reaches it, once.

    Response cache off; no hedging (a hedge would double the load); FIFO
    without SLO admission, and 2-minute TTFT and idle timeouts (nothing shed
    or cut on a slow CPU: every request is timed).
    """
    policy = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    for section, key, value in (("cache", "enabled", False), ("hedging", "enabled", False),
                                ("scheduling", "slo_admission", False), ("scheduling", "order", "fifo"),
                                ("timeouts", "ttft_ms", 120_000), ("timeouts", "idle_ms", 120_000)):
        if isinstance(policy.get(section), dict):
            policy[section][key] = value
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


def measure(stack: Stack, case: Case, max_tokens: int, seed: int) -> dict[str, Any]:
    target = Target(stack.gateway_url, http_version="1.1", ca_file=stack.ca_cert)
    factory = request_factory(max_tokens, case.long_prompt, case.name)
    result = anyio.run(lambda: run_load(target, ClosedLoop(case.users, count=case.count),
                                        factory, seed=seed))
    overall = result.summary()["overall"]
    itl_p50 = overall["itl_ms"].get("p50")
    return {
        "case": case.name, "requests": overall["requests"], "ok": overall["ok"],
        "errors": overall["errors"], "status": overall["status"], "error_codes": overall["error_codes"],
        "ttft_p50_ms": overall["ttft_ms"].get("p50"), "ttft_p95_ms": overall["ttft_ms"].get("p95"),
        "stream_tokens_per_s": round(1000.0 / itl_p50, 1) if itl_p50 else None,
        "tokens_per_s": overall["tokens_per_s"],
    }


@contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """``Stack.spawn`` passes this process's environment on: set ``extra`` around it."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def gpu_memory_in_use(pid: int) -> str | None:
    """nvidia-smi's memory figure for one process (MiB), or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    listing = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=10, check=False).stdout
    for line in listing.splitlines():
        fields = [part.strip() for part in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return f"{fields[1]} MiB"
    return None


def run_worker_cases(stack: Stack, plan: WorkerPlan, all_cases: list[Case], max_tokens: int,
                     policy: Path) -> dict[str, Any]:
    worker_id = f"{plan.name}-worker"
    with environment(plan.env):
        proc = stack.start_worker(worker_id, *plan.args)
    if stack.gateway_port == 0:
        # Pinned too: the gateway sizes its worker client's timeouts from its own policy at start.
        stack.start_gateway("--policy", str(policy))
    context = ssl.create_default_context(cafile=stack.ca_cert)
    wait_for(lambda: httpx.get(stack.gateway_url + "/readyz", verify=context).status_code == 200,
             "the gateway to see the worker")
    record = stack.worker(worker_id)
    assert record is not None
    registration = record["registration"]
    row: dict[str, Any] = {
        "worker": plan.name, "kind": registration["kind"], "device": registration.get("device"),
        "device_memory_bytes": registration.get("device_memory_bytes"),
        "slots": registration["slots"], "gpu_memory_in_use": gpu_memory_in_use(proc.popen.pid),
    }
    print(f"\n{plan.name} worker registered: {row}", flush=True)
    row["cases"] = []
    for index, case in enumerate(all_cases):
        measured = measure(stack, case, max_tokens, seed=index)
        print(f"  {case.name}: {measured}", flush=True)
        row["cases"].append(measured)
    proc.stop()
    wait_for(lambda: stack.worker(worker_id) is None, f"{worker_id} to leave the registry")
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| worker | device | case | TTFT p50 ms | TTFT p95 ms | tokens/s per stream | tokens/s total | ok |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        device = row["device"] or "host CPU"
        for case in row["cases"]:
            lines.append(f"| {row['worker']} ({row['kind']}, {row['slots']} slots) | {device} | "
                         f"{case['case']} | {_fmt(case['ttft_p50_ms'])} | {_fmt(case['ttft_p95_ms'])} | "
                         f"{_fmt(case['stream_tokens_per_s'])} | {_fmt(case['tokens_per_s'])} | "
                         f"{case['ok']}/{case['requests']} |")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return "–" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hedgerow-gpu-check"))
    parser.add_argument("--gpu-slots", type=int, default=4)
    parser.add_argument("--cpu-slots", type=int, default=1)
    parser.add_argument("--users", type=int, default=4, help="concurrent users in the last case")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="a third of the requests")
    parser.add_argument("--only", choices=("gpu", "cpu"), help="measure one worker only")
    args = parser.parse_args(argv)
    # SIGTERM (a timeout's kill) unwinds through ``finally``, which stops the processes started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.workdir)
    rows = []
    try:
        policy = measurement_policy(args.workdir)
        stack.start_control_plane(policy=policy)
        for plan in worker_plans(args.gpu_slots, args.cpu_slots, args.only):
            rows.append(run_worker_cases(stack, plan, cases(args.users, args.quick), args.max_tokens,
                                         policy))
    finally:
        stack.stop_all()
    print("\n" + table(rows), flush=True)
    sys.stdout.write(orjson.dumps({"workers": rows}).decode() + "\n")
    wrong = [row for row in rows if row["worker"] == "gpu" and row["kind"] != "gpu"]
    if wrong:
        print("FAILED: the GPU worker registered as kind "
              f"{wrong[0]['kind']!r} (a CPU-only llama-cpp-python, or no GPU visible)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
