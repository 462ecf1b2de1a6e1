"""Policy edits reach running gateways without a restart, xDS style.

A gateway that follows the control plane receives every new version, checks
it again, swaps it in, and ACKs it; `hedgerow status` shows which version it
runs. Clients notice at once: a key added to the policy works on the next
request; a limit lowered in the policy refuses the next request.
"""

from __future__ import annotations

import hashlib
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.stack import Stack, free_port, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1", "--sim-decode-ms-per-token", "1",
       "--sim-output-tokens", "4"]


def policy_text(extra_key: str | None = None, max_tokens: int = 4096) -> str:
    keys = f'["{hashlib.sha256(extra_key.encode()).hexdigest()}"]' if extra_key else "[]"
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


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("propagation")
    first = root / "first.yaml"
    first.write_text(policy_text())
    stack = Stack(root)
    try:
        stack.start_control_plane(policy=first)
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway("--gateway-id", "gw-test")
        yield stack
    finally:
        stack.stop_all()


def hedgerow(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hedgerow.cli", *args,
                           "--control-plane", stack.control_plane_url],
                          capture_output=True, text=True, timeout=30, env=stack.admin_env())


def chat(stack: Stack, key: str | None = None, max_tokens: int = 4) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(verify=ssl.create_default_context(cafile=stack.ca_cert)) as http:
        return http.post(stack.gateway_url + "/v1/chat/completions", headers=headers, json={
            "model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}]})


def gateway_runs(stack: Stack, version: int) -> bool:
    with stack.admin() as admin:
        status = admin.get("/v1/status").json()
    return any(g["gateway_id"] == "gw-test" and g["running_version"] == version
               for g in status["gateways"])


def active_version(stack: Stack) -> int:
    with stack.admin() as admin:
        return int(admin.get("/v1/policy").json()["version"])


def test_gateway_acks_the_version_in_force(stack: Stack) -> None:
    wait_for(lambda: gateway_runs(stack, 1), "the gateway to ACK version 1", timeout=10)
    out = hedgerow(stack, "status")
    assert out.returncode == 0, out.stderr
    assert "gw-test" in out.stdout and "runs v1" in out.stdout and "sim-1" in out.stdout


def test_applied_policy_reaches_the_gateway_without_restart(stack: Stack, tmp_path: Path) -> None:
    assert chat(stack, "sk-partner").status_code == 401
    edited = tmp_path / "partner.yaml"
    edited.write_text(policy_text(extra_key="sk-partner", max_tokens=16))
    applied = hedgerow(stack, "policy", "apply", str(edited))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    version = active_version(stack)
    wait_for(lambda: gateway_runs(stack, version), "the gateway to ACK the new version", 10)
    assert chat(stack, "sk-partner").status_code == 200  # the new key works
    refused = chat(stack, max_tokens=64)  # the lowered limit holds
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"

    rolled = hedgerow(stack, "policy", "rollback", "1")
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    newest = active_version(stack)
    wait_for(lambda: gateway_runs(stack, newest), "the gateway to ACK the rollback", 10)
    assert chat(stack, "sk-partner").status_code == 401
    assert chat(stack, max_tokens=64).status_code == 200


def test_a_pinned_gateway_ignores_the_control_plane(stack: Stack, tmp_path: Path) -> None:
    pinned_policy = tmp_path / "pinned.yaml"
    pinned_policy.write_text(policy_text(extra_key="sk-pinned"))
    (tmp_path / "pinned").mkdir()
    other = Stack(tmp_path / "pinned")  # its own dev certificate; this stack's control plane
    other.gateway_port = free_port()
    pinned = stack.spawn("gw-pinned", "gateway", "--port", str(other.gateway_port),
                         "--control-plane", stack.control_plane_url,
                         "--state-dir", str(other.root / "state"), *stack.join_args("gateway"),
                         "--policy", str(pinned_policy), "--gateway-id", "gw-pinned")
    try:
        wait_for(lambda: pinned.popen.poll() is not None or (other.ca_cert.exists() and httpx.get(
            other.gateway_url + "/readyz",
            verify=ssl.create_default_context(cafile=other.ca_cert)).status_code == 200),
            "the pinned gateway")
        assert pinned.popen.poll() is None, pinned.log()
        assert chat(other, "sk-pinned").status_code == 200
        with stack.admin() as admin:
            status = admin.get("/v1/status").json()
        assert all(g["gateway_id"] != "gw-pinned" for g in status["gateways"])
    finally:
        pinned.stop()
