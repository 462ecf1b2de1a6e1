"""Memory: everything a gateway keeps resident, by cache setting.

``hedgerow bench scenario memory [--quick]``. A gateway is more than its own
process once its policy turns the semantic cache on: it then starts an
embedding sidecar (``gateway.cache.embed_sidecar``) that holds MiniLM. The
shipped policy leaves the semantic part off (exact cache on), so its gateway
is one process. Each case reports the whole tree beside the gateway process.
Five cases, one after the other, each on a fresh control plane, simulated
worker and gateway:

- ``default``: ``policies/default.yaml`` as shipped (exact cache on, semantic
  part off: no sidecar), as ``hedgerow gateway --processes 1``;
- ``default_all_cores``: the same as a plain ``hedgerow gateway`` runs on
  this host: ``--processes`` = the cores it may use (a supervisor and N
  gateway processes; ``gateway_rss_mb`` is then the supervisor alone);
- ``semantic_on``: the shipped policy with ``cache.semantic.enabled: true``
  (the sidecar runs; the gateway is measured after its model is loaded,
  ``semantic_ready``), ``--processes 1``;
- ``semantic_on_all_cores``: the same with ``--processes`` = the cores (N
  gateway processes and the one sidecar they share);
- ``cache_off``: the shipped policy with ``cache.enabled: false``.

In each, after a warm-up the client sends ``requests`` distinct cacheable
questions (temperature 0, so each answer is stored: exact entries, and vectors
where the semantic cache is on) on one HTTPS connection, then the tree is read:

- ``gateway_rss_mb``: the gateway process alone (``VmRSS``);
- ``tree_rss_mb``: the gateway and every descendant, summed (counts shared
  pages once per process, so an upper bound);
- ``tree_pss_mb``: the same tree in proportional set size (shared pages split
  between the processes that map them): what the tree adds to the host;
- ``processes``: how many processes the tree holds.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.procstat import PROC, process_tree, rss_mb
from bench.shipped_policy import SEMANTIC_ON, shipped_policy, shipped_policy_text
from bench.stack import Stack, free_port, free_port_run, wait_for
from gateway.edge.processes import default_processes

log = logging.getLogger("hedgerow.bench")

MODEL = "smollm2-135m-instruct"
SEMANTIC_READY_TIMEOUT_S = 180.0
SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "16"]
ALL_CORES = {"default_all_cores", "semantic_on_all_cores"}
CASES: dict[str, Mapping[str, Any]] = {  # overrides of the shipped policy's ``cache:``
    "default": {},
    "default_all_cores": {},
    "semantic_on": SEMANTIC_ON,
    "semantic_on_all_cores": SEMANTIC_ON,
    "cache_off": {"enabled": False},
}


def wants_sidecar(name: str) -> bool:
    """Whether the case's policy turns the semantic cache on (its sidecar runs)."""
    return shipped_policy(CASES[name]).cache.semantic_on


def pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` (``/proc/PID/smaps_rollup``), in MiB."""
    for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"process {pid} has no Pss")


def tree_memory(pid: int) -> dict[str, Any]:
    members = process_tree(pid)
    return {"gateway_rss_mb": round(rss_mb(pid), 1),
            "tree_rss_mb": round(sum(rss_mb(member) for member in members), 1),
            "tree_pss_mb": round(sum(pss_mb(member) for member in members), 1),
            "processes": len(members)}


def _ask(http: httpx.Client, question: str) -> None:
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": question}]}
    reply = http.post("/v1/chat/completions", content=orjson.dumps(body),
                      headers={"content-type": "application/json"})
    if reply.status_code != 200:
        raise RuntimeError(f"{reply.status_code}: {reply.text[:200]}")



def measure_case(name: str, workdir: Path, requests: int) -> dict[str, Any]:
    root = workdir / name
    root.mkdir(parents=True, exist_ok=True)
    policy = root / "policy.yaml"
    policy.write_text(shipped_policy_text(CASES[name]))
    stack = Stack(root)
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        # One process, as ``hedgerow gateway --processes 1``; the all-cores cases
        # as a plain ``hedgerow gateway`` runs on this host (a supervisor, N
        # processes and, semantic on, the one sidecar they share; admin ports
        # admin_port + i).
        processes = default_processes() if name in ALL_CORES else 1
        admin_port = free_port() if processes == 1 else free_port_run(processes)
        gateway = stack.start_gateway("--policy", str(policy), "--admin-port", str(admin_port),
                                      "--processes", str(processes))
        admin = httpx.Client(base_url=f"https://127.0.0.1:{admin_port}", timeout=5,
                             verify=stack.admin_tls(check_hostname=False))
        started = time.monotonic()
        if wants_sidecar(name):
            wait_for(lambda: admin.get("/admin/cache").json()["semantic_ready"],
                     "the gateway's embedding model", SEMANTIC_READY_TIMEOUT_S)
        ready_s = time.monotonic() - started
        with httpx.Client(base_url=stack.gateway_url, timeout=60,
                          verify=ssl.create_default_context(cafile=str(stack.ca_cert))) as http:
            for i in range(requests):
                _ask(http, f"What is the capital of country number {i}, in one word?")
        admin.close()
        stored = entries = 0
        for index in range(processes):  # each process's own cache (no Redis here)
            with httpx.Client(base_url=f"https://127.0.0.1:{admin_port + index}", timeout=5,
                              verify=stack.admin_tls(check_hostname=False)) as one:
                stats = one.get("/admin/cache").json()
            stored += stats.get("stored") or 0
            entries += stats.get("semantic_entries") or 0
        time.sleep(1.0)  # let the last stores settle before reading the tree
        return {**tree_memory(gateway.popen.pid), "gateway_processes": processes,
                "requests": requests,
                "semantic_ready_wait_s": round(ready_s, 1),
                "cache_stored": stored, "semantic_entries": entries}
    finally:
        stack.stop_all()


def memory(quick: bool, workdir: Path) -> dict[str, Any]:
    requests = 50 if quick else 500
    result: dict[str, Any] = {"baseline": "the shipped default first (semantic cache off, no "
                                          "sidecar), then with the semantic cache on (its "
                                          "sidecar), and with the response cache off"}
    for name in CASES:
        log.info("memory: case %s", name)
        result[name] = measure_case(name, workdir, requests)
    return result
