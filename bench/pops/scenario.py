"""``hedgerow bench scenario pops``: two PoPs over a real (emulated) WAN.

Each PoP is a network namespace holding a control-plane replica, a gateway
(``--pop NAME``) and two simulated workers (``--label pop=NAME``); Redis, the
shared state of every replica, lives in the first PoP, so the second PoP's
control plane reaches it across the WAN. Between the PoPs the relay
(``bench.pops.relay``) adds the link's delay, jitter and loss to every TCP
connection. Each PoP's clients run in a namespace of their own and reach only
their PoP's gateway, with open-loop Poisson load from ``bench.loadgen``.

Phases on the one stack, the same load each time:

``local_first``  the policy's ``topology.routing: local_first``
``local_only``   ``routing: local_only``: every PoP serves only its own
                 clients, never spilling: the baseline a user would otherwise
                 run (one independent cluster per PoP)
``blind``        ``routing: blind``: any PoP's worker, by score alone
                 (the three rotate in short rounds, each applied live
                 through the control plane, so a noisy machine hits all alike)
``pop_failure``  local-first again; a third of the way in, every worker of
                 the second PoP is killed (SIGKILL): its gateway must spill
                 everything to the first PoP
``pop_failure_local_only``  then, the second PoP's workers still dead, the
                 same load under ``local_only``: what that PoP's clients get
                 without spilling (the failure phase's baseline)

TTFT is measured by the clients from the intended send time, so it includes
the WAN round trip whenever a request was served in the other PoP.

Internal trust runs as in production (mutual TLS, no ``--insecure-internal``):
the namespaces share one filesystem, so every control-plane replica runs on the
same ``--state-dir`` — the first one started makes the cluster CA and the admin
credential, the others load them (they start one after the other for that).
Each PoP's replica mints that PoP's join tokens (``hedgerow token create`` run
inside its namespace with the admin credential), and its workers and gateway
join through its join port on the PoP's loopback. A gateway reaches the other
PoP's workers over the WAN and verifies them by identity, as at home.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.pops.certs import issue
from bench.pops.netns import Pop, PopNetwork
from bench.pops.processes import Agent, PopProcesses
from bench.pops.relay import LinkShape, RelayConfig
from bench.stack import Proc
from bench.stats import percentile

log = logging.getLogger("hedgerow.bench.pops")

MODEL = "smollm2-135m-instruct"
REDIS_PORT = 6400
CONTROL_PLANE_PORT = 8500
JOIN_PORT = 8501
CONTROL_PLANE = f"https://127.0.0.1:{CONTROL_PLANE_PORT}"  # on each PoP's own loopback
GATEWAY_PORT = 8443
WORKERS_PER_POP = 2
READY_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class PopsSetup:
    pops: tuple[tuple[str, str], ...] = (("ams", "eu-west"), ("fra", "eu-central"))
    link: LinkShape = LinkShape(rtt_ms=40.0, jitter_ms=8.0, loss=0.005)
    rate_per_pop: float = 5.0
    slots: int = 2
    prefill_ms_per_token: float = 1.0
    decode_ms_per_token: float = 20.0

    def worker_port(self, pop_number: int, index: int) -> int:
        return 7000 + 100 * pop_number + index


def policy_yaml(setup: PopsSetup, routing: str) -> str:
    names = [name for name, _ in setup.pops]
    pops = "\n".join(
        f"    - {{name: {name}, region: {region}, "
        f"prefer: [{', '.join(n for n in names if n != name)}]}}"
        for name, region in setup.pops)
    rtts = ", ".join(f"{b}: {setup.link.rtt_ms:g}" for b in names[1:])
    return f"""# written by `hedgerow bench scenario pops`
scheduling: {{max_queue: 20000, slo_admission: false, order: edf, prefill_ms_per_token: 1.0}}
timeouts: {{connect_ms: 2000, ttft_ms: 30000, idle_ms: 30000}}
retries: {{before_first_token: 2}}
hedging: {{enabled: false}}   # routing alone is compared
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 30000, hedge: false}}
tenants:
  - name: local
    class: interactive
    limits: {{requests_per_s: 1000, requests_burst: 2000, tokens_per_min: 100000000,
              tokens_burst: 10000000, max_concurrency: 10000}}
models:
  - name: {MODEL}
topology:
  routing: {routing}
  pops:
{pops}
  rtt_ms: {{{names[0]}: {{{rtts}}}}}
"""


class PopsStack:
    """The running simulation: network, processes, agents."""

    def __init__(self, setup: PopsSetup, root: Path) -> None:
        self.setup = setup
        self.root = root
        self.net = PopNetwork(tuple(name for name, _ in setup.pops))
        self.procs = PopProcesses(self.net, root)
        self.workers: dict[str, list[Proc]] = {}
        self.ops: dict[str, Agent] = {}
        self.clients: dict[str, Agent] = {}
        self.policy_dir = root / "policies"
        self.policy_version = 0
        self.routing = "local_first"
        self.tokens: set[tuple[str, str]] = set()  # (pop, role) join tokens minted

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.net.build()
        certs = issue(self.root / "tls", [p.client_facing_address for p in self.net.pops])
        self.ca = str(certs.ca)
        self.policy_dir.mkdir(exist_ok=True)
        (self.policy_dir / "policy.yaml").write_text(policy_yaml(self.setup, "local_first"))
        self._start_relay()
        first = self.net.pops[0]
        self.procs.redis(first.namespace, REDIS_PORT)
        redis_url = f"redis://{first.address}:{REDIS_PORT}/0"
        for pop in self.net.pops:
            self.ops[pop.name] = self.procs.agent(pop.namespace, f"ops-{pop.name}")
        for pop, (_, region) in zip(self.net.pops, self.setup.pops):
            self._start_pop(pop, region, redis_url, with_policy_dir=pop is first)
        for pop in self.net.pops:
            self.clients[pop.name] = self.procs.agent(pop.client_namespace, f"clients-{pop.name}")
        self._wait_ready()

    @property
    def control_plane_state(self) -> Path:
        """Every replica's --state-dir: the cluster CA, the admin credential, trust.json."""
        return self.root / "control-plane"

    @property
    def cluster_ca(self) -> Path:
        return self.control_plane_state / "ca" / "ca.pem"

    @property
    def admin_identity(self) -> Path:
        return self.control_plane_state / "admin"

    def admin_get(self, pop: str, path: str) -> dict[str, Any]:
        """GET a route of ``pop``'s control plane as the operator (from inside its namespace)."""
        return self.ops[pop].ask({"op": "get", "url": CONTROL_PLANE + path,
                                  "ca": str(self.cluster_ca),
                                  "identity": str(self.admin_identity)})

    def _join_args(self, pop: Pop, role: str) -> list[str]:
        """Flags that make a worker or gateway join ``pop``'s control plane; the token
        is minted by that replica, so it is the one that knows it."""
        token = self.root / f"{pop.name}-{role}.token"
        if (pop.name, role) not in self.tokens:  # minted afresh by this run's replica
            minted = subprocess.run(
                [*self.net.exec_prefix(pop.namespace), sys.executable, "-m", "hedgerow.cli",
                 "token", "create", "--role", role, "--ttl", "24h",
                 "--description", f"bench pops {pop.name}"],
                capture_output=True, text=True, timeout=60,
                env=dict(os.environ, HEDGEROW_ADMIN_IDENTITY=str(self.admin_identity),
                         HEDGEROW_CONTROL_PLANE=CONTROL_PLANE))
            if minted.returncode != 0:
                raise RuntimeError(f"pops scenario: no join token from {pop.name}'s control "
                                   f"plane:\n{minted.stdout}{minted.stderr}")
            token.touch(mode=0o600)  # a secret: readable by this user only
            token.write_text(minted.stdout.splitlines()[0].strip())
            self.tokens.add((pop.name, role))
        return ["--join-url", f"https://127.0.0.1:{JOIN_PORT}", "--join-token-file", str(token),
                "--ca-file", str(self.cluster_ca)]

    def stop(self) -> None:
        try:
            self.procs.stop_all()
        finally:
            self.net.teardown()

    def _start_relay(self) -> None:
        names = {p.number: p.name for p in self.net.pops}
        ports = [REDIS_PORT] + [self.setup.worker_port(p.number, i)
                                for p in self.net.pops for i in range(1, WORKERS_PER_POP + 1)]
        links = {(a, b): self.setup.link for a in names.values() for b in names.values() if a != b}
        config = RelayConfig(ports=ports, pops=names, links=links, seed=7)
        path = self.root / "relay.json"
        path.write_text(json.dumps(config.to_json()))
        relay = self.procs.relay(path)
        _wait(lambda: "ready" in relay.log() or _exited(relay), "the relay")

    def _start_pop(self, pop: Pop, region: str, redis_url: str, *, with_policy_dir: bool) -> None:
        ns, cp = pop.namespace, CONTROL_PLANE
        policy = (["--policy-dir", str(self.policy_dir)] if with_policy_dir
                  else ["--policy", str(self.policy_dir / "policy.yaml")])
        control_plane = self.procs.hedgerow(
            ns, f"control-plane-{pop.name}", "control-plane", "--host", "127.0.0.1",
            "--port", str(CONTROL_PLANE_PORT), "--lease-s", "2", "--redis", redis_url,
            "--state-dir", str(self.control_plane_state), "--join-port", str(JOIN_PORT), *policy)
        # Up (and, for the first, the CA written) before the next replica loads it.
        _wait(lambda: _exited(control_plane)
              or self.admin_get(pop.name, "/healthz").get("status") == 200,
              f"{pop.name}'s control plane")
        if _exited(control_plane):
            raise RuntimeError(f"pops scenario: {pop.name}'s control plane exited:\n"
                               f"{control_plane.log()}")
        s = self.setup
        self.workers[pop.name] = [
            self.procs.hedgerow(
                ns, f"{pop.name}-{i}", "worker", "--backend", "sim", "--host", "0.0.0.0",
                "--port", str(s.worker_port(pop.number, i)), "--advertise-host", pop.address,
                "--control-plane", cp, "--worker-id", f"{pop.name}-{i}",
                "--state-dir", str(self.root / f"state-{pop.name}"),
                *self._join_args(pop, "worker"),
                "--label", f"pop={pop.name}", "--label", f"region={region}",
                "--slots", str(s.slots), "--sim-prefill-ms-per-token", str(s.prefill_ms_per_token),
                "--sim-decode-ms-per-token", str(s.decode_ms_per_token), "--sim-jitter", "0.1",
                "--sim-seed", str(10 * pop.number + i))
            for i in range(1, WORKERS_PER_POP + 1)]
        certs = self.root / "tls"
        self.procs.hedgerow(ns, f"gateway-{pop.name}", "gateway", "--host",
                            pop.client_facing_address, "--port", str(GATEWAY_PORT),
                            "--control-plane", cp, "--state-dir", str(self.root / f"state-{pop.name}"),
                            "--certfile", str(certs / "cert.pem"), "--keyfile", str(certs / "key.pem"),
                            "--pop", pop.name, "--gateway-id", f"gw-{pop.name}",
                            "--processes", "1",  # one per PoP, as measured before the flag
                            *self._join_args(pop, "gateway"))

    def _wait_ready(self) -> None:
        expected = len(self.net.pops) * WORKERS_PER_POP
        for pop in self.net.pops:
            _wait(lambda: len(self.status(pop.name).get("workers", [])) == expected,
                  f"{pop.name}'s control plane to list {expected} workers")
            url = f"https://{pop.client_facing_address}:{GATEWAY_PORT}/readyz"
            _wait(lambda: self.clients[pop.name].ask({"op": "get", "url": url, "ca": self.ca})
                  .get("status") == 200, f"gateway {pop.name} /readyz")
        self.policy_version = self._wait_policy_running(min_version=1)
        time.sleep(1.0)  # the gateways' registry watch catches up with the last worker

    def status(self, pop: str) -> dict[str, Any]:
        body = self.admin_get(pop, "/v1/status").get("json")
        return body if isinstance(body, dict) else {}

    def _wait_policy_running(self, min_version: int) -> int:
        """Wait until every gateway runs one version >= ``min_version``; return it."""
        found: dict[str, int] = {}

        def every_gateway_runs_it() -> bool:
            for pop in self.net.pops:
                status = self.status(pop.name)
                version = int(status.get("policy", {}).get("version", 0))
                running = {row["gateway_id"]: row["running_version"]
                           for row in status.get("gateways", [])}
                if version < min_version or running.get(f"gw-{pop.name}") != version:
                    return False
                found[pop.name] = version
            return len(set(found.values())) == 1

        _wait(every_gateway_runs_it, f"every gateway to run policy version >= {min_version}")
        return next(iter(found.values()))

    def apply_routing(self, routing: str) -> None:
        """Apply ``topology.routing: ROUTING`` through the control plane, live."""
        if routing == self.routing:
            return  # the same text again would be no new version
        staged = self.root / "staged.yaml"
        staged.write_text(policy_yaml(self.setup, routing))
        staged.replace(self.policy_dir / "policy.yaml")
        self.policy_version = self._wait_policy_running(self.policy_version + 1)
        self.routing = routing

    def drive(self, duration_s: float, seed: int,
              during: Callable[[], None] | None = None, after_s: float = 0.0) -> list[dict[str, Any]]:
        """The same open-loop load at every PoP's gateway at once; ``during`` runs after ``after_s``."""
        for k, (pop, agent) in enumerate(self.clients.items()):
            agent.send({"op": "load", "url": f"https://{self.net.pop(pop).client_facing_address}:"
                        f"{GATEWAY_PORT}", "ca": self.ca, "rate": self.setup.rate_per_pop,
                        "duration": duration_s, "seed": seed + 1000 * k, "tag": pop})
        if during is not None:
            time.sleep(after_s)
            during()
        records: list[dict[str, Any]] = []
        for agent in self.clients.values():
            records.extend(agent.answer(timeout=duration_s + 120)["records"])
        return records

    def kill_workers(self, pop: str) -> None:
        for proc in self.workers[pop]:
            proc.popen.send_signal(signal.SIGKILL)
        for proc in self.workers[pop]:
            proc.popen.wait(10)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = sorted(r["ttft_s"] for r in records if r["ok"] and r["ttft_s"] is not None)
    served = [r for r in records if r["ok"]]
    remote = [r for r in served if r["worker"] and not r["worker"].startswith(r["tag"] + "-")]
    return {
        "requests": len(records),
        "served_fraction": round(len(served) / max(1, len(records)), 4),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)) if ttfts else None,
        "ttft_p99_ms": _ms(percentile(ttfts, 99)) if ttfts else None,
        "served_in_other_pop": round(len(remote) / max(1, len(served)), 4),
        "errors": _tally(r["detail"] or r["error"] for r in records if not r["ok"]),
    }


ROUTINGS = ("local_first", "local_only", "blind")


def pops(quick: bool, workdir: Path) -> dict[str, Any]:
    # The routings rotate in short rounds, each round starting with another, so
    # the noise of a shared machine lands on all alike; the failure phases run last.
    rounds, round_s, failure_s = (3, 8.0, 30.0) if quick else (6, 15.0, 60.0)
    setup = PopsSetup()
    stack = PopsStack(setup, workdir / "pops")
    started = time.monotonic()
    load_before = round(os.getloadavg()[0], 2)
    phases: dict[str, list[dict[str, Any]]] = {name: [] for name in ROUTINGS}
    per_round: dict[str, list[float | None]] = {name: [] for name in ROUTINGS}
    victim = setup.pops[-1][0]
    try:
        stack.start()
        stack.drive(5.0, seed=1)  # warm-up: connections, service-time estimates
        for n in range(rounds):
            for routing in ROUTINGS[n % 3:] + ROUTINGS[:n % 3]:
                stack.apply_routing(routing)
                records = stack.drive(round_s, seed=11 + n)
                phases[routing] += records
                per_round[routing].append(summarize(records)["ttft_p50_ms"])
        stack.apply_routing("local_first")
        phases["pop_failure"] = stack.drive(failure_s, seed=23, after_s=failure_s / 3,
                                            during=lambda: stack.kill_workers(victim))
        stack.apply_routing("local_only")
        phases["pop_failure_local_only"] = stack.drive(failure_s * 2 / 3, seed=29)
    finally:
        stack.stop()
    for name, records in phases.items():
        (stack.root / f"records-{name}.json").write_text(json.dumps(records))
    failure = phases["pop_failure"]
    # After the kill only: what the victim PoP's clients got once its workers were gone.
    after_kill = [r for r in failure if r.get("intended_s", 0.0) >= failure_s / 3]
    baseline_failure = phases["pop_failure_local_only"]
    return {
        "baseline": "local_only",
        "baselines": {"local_only": "each PoP serves only its own clients (independent "
                                    "clusters: what a user would otherwise run)",
                      "blind": "any PoP's worker by score alone (locality ignored)"},
        "pops": [name for name, _ in setup.pops],
        "link": {"rtt_ms": setup.link.rtt_ms, "jitter_ms": setup.link.jitter_ms,
                 "loss": setup.link.loss},
        "offered_rps_per_pop": setup.rate_per_pop,
        "rounds": f"{rounds} x {round_s:g}s each per routing, rotating",
        "workers_per_pop": f"{WORKERS_PER_POP} x {setup.slots} slots",
        "wall_s": round(time.monotonic() - started, 1),
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        **{routing: {**summarize(phases[routing]), "ttft_p50_ms_by_round": per_round[routing]}
           for routing in ROUTINGS},
        "pop_failure": {**summarize(failure), "duration_s": failure_s,
                        "killed": f"every worker of {victim} at {failure_s / 3:g}s",
                        victim: summarize([r for r in failure if r["tag"] == victim]),
                        f"{victim}_after_kill": summarize(
                            [r for r in after_kill if r["tag"] == victim])},
        "pop_failure_local_only": {
            **summarize(baseline_failure), "duration_s": failure_s * 2 / 3,
            "state": f"{victim}'s workers dead throughout, routing local_only",
            victim: summarize([r for r in baseline_failure if r["tag"] == victim])},
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _tally(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return dict(sorted(out.items()))


def _exited(proc: Proc) -> bool:
    return proc.popen.poll() is not None


def _wait(predicate: Callable[[], bool], what: str, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise TimeoutError(f"pops scenario: timed out waiting for {what}")
