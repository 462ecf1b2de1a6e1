"""Policy edits under live traffic, and a control plane that goes away.

A new policy governs new requests within a second, while streams already
running finish untouched; gateways keep serving on their last known state
while the control plane is down, and resync when it returns.
"""

from __future__ import annotations

import hashlib
import signal
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
SLOW_SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
            "--sim-decode-ms-per-token", "25", "--sim-output-tokens", "60"]


def policy(key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"""
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - {{name: local, class: interactive}}
  - {{name: partner, class: interactive, api_key_sha256: ["{digest}"]}}
models:
  - {{name: {MODEL}}}
"""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    first = tmp_path / "v1.yaml"
    first.write_text(policy("sk-old"))
    stack = Stack(tmp_path)
    try:
        stack.start_control_plane(policy=first)
        stack.start_worker("sim-1", *SLOW_SIM)
        stack.start_gateway("--gateway-id", "gw-live")
        wait_for(lambda: _runs(stack, 1), "the gateway to run version 1", 10)
        yield stack
    finally:
        stack.stop_all()


def _runs(stack: Stack, version: int) -> bool:
    with stack.admin() as admin:
        status = admin.get("/v1/status").json()
    return any(g["running_version"] == version for g in status.get("gateways", []))


def _apply(stack: Stack, text: str) -> httpx.Response:
    with stack.admin() as admin:
        return admin.post("/v1/policy", content=text)


def _client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, timeout=30,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def _stream(stack: Stack, key: str, results: list[str]) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    with _client(stack) as http:
        with http.stream("POST", "/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {key}"}) as response:
            text = "".join(response.iter_text())
    results.append(f"{response.status_code}:{text.rstrip().endswith('data: [DONE]')}")


def _status_with(stack: Stack, key: str) -> int:
    with _client(stack) as http:
        return http.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                         json={"model": MODEL, "max_tokens": 1,
                               "messages": [{"role": "user", "content": "hi"}]}).status_code


def test_new_policy_governs_new_requests_within_a_second_and_drops_no_stream(
        stack: Stack) -> None:
    results: list[str] = []
    streams = [threading.Thread(target=_stream, args=(stack, "sk-old", results))
               for _ in range(4)]
    for thread in streams:
        thread.start()
    time.sleep(0.3)  # the streams are running (60 tokens x 25 ms each)
    applied_at = time.monotonic()
    response = _apply(stack, policy("sk-new"))
    assert response.status_code in (200, 201), response.text
    wait_for(lambda: _status_with(stack, "sk-new") == 200, "the new key to work", timeout=1.0)
    assert time.monotonic() - applied_at < 1.0
    assert _status_with(stack, "sk-old") == 401
    for thread in streams:
        thread.join(timeout=30)
    # The streams that started under the old policy all finished cleanly.
    assert results == ["200:True"] * 4


def test_gateway_keeps_serving_while_the_control_plane_is_down_and_resyncs(
        stack: Stack) -> None:
    control_plane = next(p for p in stack.procs if p.name == "control-plane")
    control_plane.stop(signal.SIGKILL)
    stack.procs.remove(control_plane)
    # Last known registry and policy: still serving, the old key still works.
    for _ in range(3):
        assert _status_with(stack, "sk-old") == 200
    policy_file = stack.root / "v1.yaml"
    port = stack.control_plane_port
    # Same state directory: the same cluster CA, so the certificates the worker and
    # the gateway hold are still good.
    restarted = stack.spawn("control-plane-2", "control-plane", "--port", str(port),
                            "--lease-s", "2.0", "--policy", str(policy_file),
                            *stack.control_plane_args(stack.join_port))
    stack.wait_control_plane(restarted, stack.control_plane_url, "the control plane to come back")
    # The worker re-registers on its next heartbeat; the gateway re-follows
    # both streams and ACKs the (restarted) control plane's version.
    wait_for(lambda: stack.worker("sim-1") is not None, "the worker to re-register", 10)
    wait_for(lambda: _runs(stack, 1), "the gateway to resync its policy", 10)
    assert _status_with(stack, "sk-old") == 200
    assert restarted.popen.poll() is None


def test_invalid_policy_under_load_changes_nothing(stack: Stack) -> None:
    results: list[str] = []
    streams = [threading.Thread(target=_stream, args=(stack, "sk-old", results))
               for _ in range(3)]
    for thread in streams:
        thread.start()
    time.sleep(0.3)
    broken = policy("sk-new").replace("ttft_slo_ms: 1000", "ttft_slo_ms: soon")
    response = _apply(stack, broken)
    assert response.status_code == 400
    issue = response.json()["issues"][0]
    assert issue["path"] == "classes[0].ttft_slo_ms" and issue["line"] > 0
    with stack.admin() as admin:
        assert admin.get("/v1/policy").json()["version"] == 1
    assert _status_with(stack, "sk-old") == 200 and _status_with(stack, "sk-new") == 401
    for thread in streams:
        thread.join(timeout=30)
    assert results == ["200:True"] * 3
    assert _runs(stack, 1)
