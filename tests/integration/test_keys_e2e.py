"""Virtual keys and budgets across two gateways that follow one control plane
and share one Redis, in front of a simulated worker (the point is the keys'
propagation and the shared budget, not the model).

``hedgerow key create`` → the key works on both gateways → ``hedgerow key
revoke`` → both answer 401 about a second later (the policy watch); an
expired key gets 401 ``expired_api_key``; a model outside the key's allowlist
403 ``model_not_allowed``; a budget spent through one gateway is refused by
the other too (429 ``budget_exceeded``).
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "4"]
POLICY = f"""
hedging: {{enabled: false}}
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - {{name: acme, class: interactive}}
models:
  - {{name: {MODEL}}}
  - {{name: other-model}}
"""
# Propagation is about a second; a loaded 2-core machine gets more room.
PROPAGATION_LIMIT_S = 10.0
TTL_S = 6


@dataclass
class Cluster:
    stack: Stack
    urls: tuple[str, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory,
            redis_server: RedisServer) -> Iterator[Cluster]:  # noqa: F811
    root = tmp_path_factory.mktemp("keys")
    (root / "policy.yaml").write_text(POLICY)
    stack = Stack(root)
    try:
        stack.start_control_plane(policy=root / "policy.yaml")
        stack.start_worker("sim-1", *SIM)
        urls = []
        for name in ("a", "b"):
            stack.start_gateway("--redis", redis_server.url, "--gateway-id", f"gw-{name}")
            urls.append(stack.gateway_url)
        yield Cluster(stack, (urls[0], urls[1]))
    finally:
        stack.stop_all()


def chat(cluster: Cluster, url: str, key: str, model: str = MODEL,
         max_tokens: int = 4) -> httpx.Response:
    with httpx.Client(timeout=10, verify=ssl.create_default_context(
            cafile=cluster.stack.ca_cert)) as http:
        return http.post(url + "/v1/chat/completions",
                         headers={"authorization": f"Bearer {key}"},
                         json={"model": model, "max_tokens": max_tokens,
                               "messages": [{"role": "user", "content": "hello there"}]})


def cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "hedgerow.cli", "key", *args],
                          capture_output=True, text=True, timeout=60,
                          env=cluster.stack.admin_env())
    assert done.returncode == 0, done.stderr
    return done


def create(cluster: Cluster, **body: Any) -> str:
    """A new key, once both gateways run the policy version that carries it."""
    with cluster.stack.admin() as admin:
        reply = admin.post("/v1/keys", json={"tenant": "acme", **body})
    assert reply.status_code == 201, reply.text
    wait_for(lambda: runs(cluster, int(reply.json()["version"])), "both gateways to run the "
             "version with the new key", timeout=PROPAGATION_LIMIT_S)
    return str(reply.json()["key"])


def runs(cluster: Cluster, version: int) -> bool:
    with cluster.stack.admin() as admin:
        gateways = admin.get("/v1/status").json()["gateways"]
    return bool(sum((g["running_version"] or 0) >= version for g in gateways) == 2)


def works_everywhere(cluster: Cluster, key: str) -> bool:
    return all(chat(cluster, url, key).status_code == 200 for url in cluster.urls)


def test_create_use_revoke_is_refused_by_every_gateway(cluster: Cluster) -> None:
    created = cli(cluster, "create", "--tenant", "acme", "--name", "ci")
    key = created.stdout.strip()
    assert key.startswith("sk-hr-") and "shown only this once" in created.stderr
    wait_for(lambda: works_everywhere(cluster, key), "the new key on both gateways",
             timeout=PROPAGATION_LIMIT_S)
    listed = cli(cluster, "list").stdout
    key_id = next(line.split()[0] for line in listed.splitlines() if " ci " in line)
    assert key not in listed and key[6:] not in listed
    with cluster.stack.admin() as admin:  # not in the policy text either
        assert key[6:] not in admin.get("/v1/policy").json()["text"]
    cli(cluster, "revoke", key_id)
    revoked_at = time.monotonic()
    wait_for(lambda: all(chat(cluster, url, key).status_code == 401 for url in cluster.urls),
             "both gateways to refuse the revoked key", timeout=PROPAGATION_LIMIT_S)
    print(f"revoked key refused by both gateways after {time.monotonic() - revoked_at:.2f} s")
    answer = chat(cluster, cluster.urls[0], key)
    assert answer.json()["error"]["code"] == "invalid_api_key"


def test_an_expired_key_gets_401(cluster: Cluster) -> None:
    started = time.monotonic()
    key = create(cluster, ttl_s=TTL_S)
    works = works_everywhere(cluster, key)
    if time.monotonic() - started < TTL_S:  # else too slow to see it work before it expired
        assert works
    wait_for(lambda: chat(cluster, cluster.urls[1], key).status_code == 401, "expiry",
             timeout=15)
    assert chat(cluster, cluster.urls[0], key).json()["error"]["code"] == "expired_api_key"


def test_a_model_outside_the_allowlist_is_403(cluster: Cluster) -> None:
    key = create(cluster, models=[MODEL])
    assert works_everywhere(cluster, key)
    refused = chat(cluster, cluster.urls[0], key, model="other-model")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "model_not_allowed"


def test_a_budget_spent_through_one_gateway_is_refused_by_the_other(cluster: Cluster) -> None:
    key = create(cluster, budgets=[{"period": "day", "tokens": 60}])
    statuses = [chat(cluster, cluster.urls[0], key).status_code for _ in range(30)]
    assert 429 in statuses, statuses  # 60 tokens are a few requests' worth
    refused = chat(cluster, cluster.urls[1], key)  # gateway B never served this key
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "budget_exceeded"
    assert "60 tokens per day" in error["message"] and "resets at" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    # Another key of the same tenant has no budget of its own: still served on B.
    assert chat(cluster, cluster.urls[1], create(cluster)).status_code == 200


def test_a_keys_own_rate_holds_across_gateways(cluster: Cluster) -> None:
    # One request per 100 s (a burst of one): the second, on the other gateway, waits.
    key = create(cluster, requests_per_s=0.01)
    assert chat(cluster, cluster.urls[0], key).status_code == 200
    refused = chat(cluster, cluster.urls[1], key)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "requests_rate"
    assert "shared by all gateways" in refused.json()["error"]["message"]


def test_the_key_api_refuses_what_it_cannot_store(cluster: Cluster) -> None:
    with cluster.stack.admin() as admin:
        unknown = admin.post("/v1/keys", json={"tenant": "nobody"})
        assert unknown.status_code == 400 and "tenant 'nobody'" in unknown.text
        bad = admin.post("/v1/keys", json={"tenant": "acme", "budgets": [{"period": "week",
                                                                          "tokens": 5}]})
        assert bad.status_code == 400 and "period" in bad.text
        for ttl in (True, "inf", -1, 1e12):  # a bool or a string is no number of seconds
            odd = admin.post("/v1/keys", json={"tenant": "acme", "ttl_s": ttl})
            assert odd.status_code == 400 and "ttl_s" in odd.text, (ttl, odd.text)
        assert admin.delete("/v1/keys/key_00000000deadbeef").status_code == 404
    # A gateway certificate may fetch the key secret; the admin may not.
    with cluster.stack.admin() as admin:
        assert admin.get("/v1/keys/secret").status_code == 403
