"""Two control-plane replicas on one real redis-server, as separate processes.

The worker heartbeats to replica B, one gateway follows B and another follows
A, and the operator edits policy through A. Killing A (SIGKILL) stops
nothing: traffic flows and edits made through B still reach the gateway.
Restarting Redis empty makes the replicas re-seed the workers and the policy
they last knew.
"""

from __future__ import annotations

import hashlib
import signal
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.redis_server import RedisServer, redis_server
from tests.support.stack import Proc, Stack, free_port, wait_for

__all__ = ["redis_server"]

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "1",
       "--sim-output-tokens", "4"]


def policy_text(key: str | None = None, max_tokens: int = 4096) -> str:
    keys = f'["{hashlib.sha256(key.encode()).hexdigest()}"]' if key else "[]"
    return f"""
limits: {{max_tokens: {max_tokens}}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - {{name: local, class: interactive}}
  - {{name: partner, class: interactive, api_key_sha256: {keys}}}
models:
  - {{name: {MODEL}}}
"""


@dataclass
class Cluster:
    stack: Stack  # its control plane is replica B; its gateway follows B
    other: Stack  # a second gateway, following replica A
    replica_a: Proc
    url_a: str
    worker: Proc
    redis: RedisServer

    @property
    def url_b(self) -> str:
        return self.stack.control_plane_url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            redis_server: RedisServer) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("scale-out")
    (root / "first.yaml").write_text(policy_text())
    (root / "other").mkdir()
    stack, other = Stack(root), Stack(root / "other")
    # One cluster, one CA: both replicas run on the same --state-dir (A makes the
    # CA, B loads it), and the second gateway's stack reads the same CA and admin
    # credential; it joins through replica A's join port.
    (root / "other" / "control-plane").symlink_to(stack.control_plane_state)
    try:
        join_a = free_port()
        replica_a, url_a = stack.start_control_plane_replica(
            "control-plane-a", policy=root / "first.yaml", redis_url=redis_server.url,
            join_port=join_a)
        stack.start_control_plane(policy=root / "first.yaml", redis_url=redis_server.url)
        worker = stack.start_worker("sim-1", *SIM)
        stack.start_gateway("--gateway-id", "gw-b")
        other.control_plane_port = int(url_a.rsplit(":", 1)[1])
        other.join_port = join_a
        other.start_gateway("--gateway-id", "gw-a")
        yield Cluster(stack, other, replica_a, url_a, worker, redis_server)
    finally:
        other.stop_all()
        stack.stop_all()


def chat(stack: Stack, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(verify=ssl.create_default_context(cafile=stack.ca_cert)) as http:
        return http.post(stack.gateway_url + "/v1/chat/completions", headers=headers, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


def admin_get(cluster: Cluster, url: str, path: str) -> httpx.Response:
    """GET a replica's route as the operator (the cluster's admin credential)."""
    with cluster.stack.admin(url) as admin:
        return admin.get(path)


def apply(cluster: Cluster, url: str, text: str, source: str) -> int:
    with cluster.stack.admin(url) as admin:
        response = admin.post("/v1/policy", params={"source": source}, content=text)
    assert response.status_code in (200, 201), response.text
    return int(response.json()["version"])


def gateway_runs(cluster: Cluster, url: str, gateway_id: str, version: int) -> bool:
    status = admin_get(cluster, url, "/v1/status").json()
    return any(g["gateway_id"] == gateway_id and g["running_version"] == version
               for g in status["gateways"])


def worker_ids(cluster: Cluster, url: str) -> list[str]:
    return [w["registration"]["worker_id"]
            for w in admin_get(cluster, url, "/v1/workers").json()["workers"]]


def log_tails(cluster: Cluster, lines: int = 25) -> str:
    """What each process said last: the diagnosis when a wait times out."""
    return "\n".join(
        f"--- {proc.log_path.name}\n" + "\n".join(proc.log().splitlines()[-lines:])
        for proc in cluster.stack.procs)


def test_both_replicas_see_the_worker_and_both_gateways_serve_it(cluster: Cluster) -> None:
    assert worker_ids(cluster, cluster.url_a) == worker_ids(cluster, cluster.url_b) == ["sim-1"]
    for stack in (cluster.stack, cluster.other):
        response = chat(stack)
        assert response.status_code == 200, response.text
        assert response.headers["x-hedgerow-worker"] == "sim-1"


def test_an_edit_through_a_reaches_the_gateway_that_follows_b(cluster: Cluster) -> None:
    assert chat(cluster.stack, "sk-one").status_code == 401
    version = apply(cluster, cluster.url_a, policy_text(key="sk-one"), "one.yaml")
    assert admin_get(cluster, cluster.url_b, "/v1/policy").json()["version"] == version
    wait_for(lambda: gateway_runs(cluster, cluster.url_b, "gw-b", version), "gw-b to ACK", 10)
    assert chat(cluster.stack, "sk-one").status_code == 200
    wait_for(lambda: gateway_runs(cluster, cluster.url_a, "gw-a", version), "gw-a to ACK", 10)
    assert chat(cluster.other, "sk-one").status_code == 200


def test_killing_replica_a_stops_neither_traffic_nor_edits(cluster: Cluster) -> None:
    cluster.replica_a.stop(signal.SIGKILL)
    assert chat(cluster.stack).status_code == 200
    assert chat(cluster.other).status_code == 200  # its gateway serves what it last knew
    version = apply(cluster, cluster.url_b, policy_text(key="sk-two"), "two.yaml")
    wait_for(lambda: gateway_runs(cluster, cluster.url_b, "gw-b", version), "gw-b to ACK", 10)
    assert chat(cluster.stack, "sk-two").status_code == 200
    history = admin_get(cluster, cluster.url_b, "/v1/policy/history").json()
    assert [v["source"] for v in history["versions"]][-2:] == ["one.yaml", "two.yaml"]


def test_a_redis_restart_loses_no_worker_and_no_policy(cluster: Cluster) -> None:
    before = admin_get(cluster, cluster.url_b, "/v1/policy").json()
    cluster.redis.restart()  # no persistence: every key is gone
    # The replicas re-seed the worker they last published: it never leaves the
    # list, and its next heartbeat renews the re-seeded lease.
    # Whichever replica ticks first puts it back (the other then finds the version
    # restored); or the worker's own heartbeat, told "unknown", registers it again.
    def restored() -> bool:
        return any("re-seeded" in p.log() or "registering again" in p.log()
                   for p in cluster.stack.procs)

    try:
        wait_for(restored, "a replica (or the worker) to restore the registry", 30)
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{log_tails(cluster)}") from None
    assert worker_ids(cluster, cluster.url_b) == ["sim-1"]
    time.sleep(3)  # longer than the lease (2 s): only heartbeats can have kept it
    assert worker_ids(cluster, cluster.url_b) == ["sim-1"]
    after = admin_get(cluster, cluster.url_b, "/v1/policy").json()
    assert (after["version"], after["checksum"]) == (before["version"], before["checksum"])
    assert chat(cluster.stack, "sk-two").status_code == 200
    version = apply(cluster, cluster.url_b, policy_text(key="sk-three"), "three.yaml")
    assert version == before["version"] + 1
    wait_for(lambda: gateway_runs(cluster, cluster.url_b, "gw-b", version), "gw-b to ACK", 10)
    assert chat(cluster.stack, "sk-three").status_code == 200
