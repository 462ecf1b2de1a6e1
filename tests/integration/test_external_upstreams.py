"""External upstreams against real processes.

The "llama-server" here is a Hedgerow sim worker serving the model under its
own name (``sim-upstream``) and pointed at a control plane that does not exist,
so it never registers itself: it is known only because the policy declares it
(or an operator registers it through the admin API) and the control plane's
probes find it healthy. Like a real llama-server it is outside Hedgerow's
internal trust: plain HTTP (``--insecure-internal``), no certificate. The
control plane itself runs with mutual TLS and an admin token, so the admin
API wants both the admin certificate and the token.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.stack import Proc, Stack, free_port, wait_for

pytestmark = pytest.mark.e2e

TOKEN = "admin-secret-for-tests-0123456789"
CLIENT_MODEL = "smol-external"
UPSTREAM_MODEL = "sim-upstream"
PROBE_MS = 300
SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "1",
       "--sim-output-tokens", "4", "--model-name", UPSTREAM_MODEL]


def policy_text(upstream_port: int | None) -> str:
    upstream = "" if upstream_port is None else f"""
upstreams:
  - name: llama
    url: http://127.0.0.1:{upstream_port}
    models: [{CLIENT_MODEL}]
    model_map: {{{CLIENT_MODEL}: {UPSTREAM_MODEL}}}
    labels: {{vendor: llama-server}}
    probe_interval_ms: {PROBE_MS}
    probe_timeout_ms: 500
"""
    return f"""
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 2000, deadline_ms: 20000}}
tenants:
  - {{name: local, class: interactive}}
{upstream}"""


def start_upstream(stack: Stack, name: str, port: int) -> Proc:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: it never registers
    proc = stack.spawn(name, "worker", "--port", str(port), "--worker-id", name,
                       "--control-plane", nowhere, "--insecure-internal", *SIM)
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200,
             f"upstream {name}")
    return proc


def admin(token: str = TOKEN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def start_gateway(stack: Stack, *extra: str) -> None:
    """``stack.start_gateway``, with a join token minted with the admin token too."""
    with stack.admin(headers=admin()) as operator:
        minted = operator.post("/v1/tokens", json={"role": "gateway", "ttl_s": 600})
    assert minted.status_code == 201, minted.text
    token = stack.root / "gateway.token"
    token.write_text(minted.json()["token"])
    stack.gateway_port = free_port()
    proc = stack.spawn("gateway", "gateway", "--port", str(stack.gateway_port),
                       "--control-plane", stack.control_plane_url,
                       "--state-dir", str(stack.root / "state"), "--join-url", stack.join_url,
                       "--join-token-file", str(token), "--ca-file", str(stack.cluster_ca), *extra)
    wait_for(lambda: proc.popen.poll() is not None or (stack.ca_cert.exists() and httpx.get(
        stack.gateway_url + "/healthz", verify=ssl.create_default_context(
            cafile=stack.ca_cert)).status_code == 200), "gateway /healthz")
    assert proc.popen.poll() is None, proc.log()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("upstreams")
    stack = Stack(root)
    upstream_port = free_port()
    (root / "policy.yaml").write_text(policy_text(upstream_port))
    (root / "token").write_text(TOKEN + "\n")
    try:
        start_upstream(stack, "llama-server", upstream_port)
        stack.control_plane_port, stack.join_port = free_port(), free_port()
        proc = stack.spawn("control-plane", "control-plane", "--port",
                           str(stack.control_plane_port), "--lease-s", "2", "--policy",
                           str(root / "policy.yaml"), "--admin-token-file", str(root / "token"),
                           *stack.control_plane_args(stack.join_port))
        stack.wait_control_plane(proc, stack.control_plane_url)
        start_gateway(stack, "--gateway-id", "gw-upstreams")
        yield stack
    finally:
        stack.stop_all()


def chat_stream(stack: Stack) -> tuple[httpx.Headers, list[dict[str, Any]]]:
    body = {"model": CLIENT_MODEL, "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(verify=ssl.create_default_context(cafile=stack.ca_cert),
                      timeout=30) as http:
        with http.stream("POST", stack.gateway_url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            headers = r.headers
    assert lines[-1] == "data: [DONE]"
    return headers, [orjson.loads(line[6:]) for line in lines[:-1]]


def test_declared_upstream_is_listed_streamed_from_and_dropped_when_it_dies(
        stack: Stack) -> None:
    record = wait_for(lambda: stack.worker("llama"), "the declared upstream to be listed", 10)
    registration = record["registration"]
    assert registration["external"] is True
    assert registration["models"] == [CLIENT_MODEL]
    assert registration["labels"] == {"vendor": "llama-server"}
    assert stack.worker("llama-server") is None  # it never registered itself
    status = subprocess.run(
        [sys.executable, "-m", "hedgerow.cli", "status", "--control-plane",
         stack.control_plane_url], capture_output=True, text=True, timeout=30,
        env=dict(stack.admin_env(), HEDGEROW_ADMIN_TOKEN=TOKEN))
    assert status.returncode == 0, status.stderr
    assert any(line.split()[:2] == ["llama", "cpu"] and "external" in line
               for line in status.stdout.splitlines()), status.stdout

    wait_for(lambda: httpx.get(stack.gateway_url + "/v1/models", verify=ssl.create_default_context(
        cafile=stack.ca_cert)).status_code == 200, "gateway")
    headers, chunks = wait_for(lambda: _try_chat(stack), "the gateway to route to llama", 10)
    assert headers["x-hedgerow-worker"] == "llama"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text  # tokens streamed through from the upstream, which knows the model by its own name

    upstream = next(p for p in stack.procs if p.name == "llama-server")
    upstream.stop()
    gone_at = time.monotonic()
    wait_for(lambda: stack.worker("llama") is None, "the dead upstream to leave", 5)
    assert time.monotonic() - gone_at < 3 * PROBE_MS / 1000 + 1.0
    log = next(p for p in stack.procs if p.name == "control-plane").log()
    assert log.count("upstream llama at") == 2  # one line per state change: up, then down
    assert TOKEN not in log


def _try_chat(stack: Stack) -> tuple[httpx.Headers, list[dict[str, Any]]] | None:
    try:
        return chat_stream(stack)
    except AssertionError:
        return None


def test_upstreams_registered_through_the_api_need_the_admin_token(stack: Stack) -> None:
    port = free_port()
    start_upstream(stack, "vllm-like", port)
    spec = {"name": "vllm", "url": f"http://127.0.0.1:{port}", "models": [UPSTREAM_MODEL],
            "kind": "gpu", "probe_interval_ms": PROBE_MS}
    url = "/v1/upstreams"
    with stack.admin() as operator:  # the admin certificate; the token only where sent
        refused = operator.post(url, json=spec)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_admin_token"
        bad = operator.post(url, json=spec | {"url": "ftp://x"}, headers=admin())
        assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]

        assert operator.post(url, json=spec, headers=admin()).status_code == 202
        record = wait_for(lambda: stack.worker("vllm"), "the registered upstream", 10)
        assert record["registration"]["kind"] == "gpu"
        listed = operator.get(url, headers=admin()).json()["upstreams"]
        assert {row["name"]: row["source"] for row in listed}["vllm"] == "api"

        assert operator.delete(url + "/vllm").status_code == 401
        assert operator.delete(url + "/vllm", headers=admin()).status_code == 200
        wait_for(lambda: stack.worker("vllm") is None, "the removed upstream to leave", 5)
        assert operator.delete(url + "/vllm", headers=admin()).status_code == 404
    # The token without the admin certificate is refused in the TLS handshake.
    with pytest.raises(httpx.HTTPError):
        httpx.get(stack.control_plane_url + url, headers=admin(),
                  verify=ssl.create_default_context(cafile=stack.cluster_ca))


def test_policy_edits_to_upstreams_take_effect_without_restart(stack: Stack) -> None:
    port = free_port()
    start_upstream(stack, "llama-server-2", port)
    with stack.admin(headers=admin()) as operator:
        assert operator.post("/v1/policy", content=policy_text(port)).status_code == 201
        record = wait_for(lambda: stack.worker("llama"), "the re-declared upstream", 10)
        assert record["registration"]["url"] == f"http://127.0.0.1:{port}"

        assert operator.post("/v1/policy", content=policy_text(None)).status_code == 201
    wait_for(lambda: stack.worker("llama") is None, "the undeclared upstream to leave", 5)
