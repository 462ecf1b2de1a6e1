"""Tail control end to end: real gateway, control plane and simulated workers.

A worker that fails before its first token costs the client nothing (retried
elsewhere, invisibly); its circuit breaker opens, traffic stops going to it,
and once it is healthy again a probe closes the breaker. Overload beyond a
tenant's concurrency is refused at the door with 429 and Retry-After.
"""

from __future__ import annotations

import hashlib
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
FAST = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1",
        "--sim-decode-ms-per-token", "2", "--sim-output-tokens", "8"]

POLICY = f"""
breaker: {{failures_to_open: 2, open_for_ms: 1500, max_open_for_ms: 1500}}
retries: {{before_first_token: 1}}
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - name: local
    class: interactive
  - name: tiny
    class: interactive
    api_key_sha256: ["{hashlib.sha256(b'sk-tiny').hexdigest()}"]
    limits: {{max_concurrency: 1}}
models:
  - name: {MODEL}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("tail")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(root)
    try:
        stack.start_control_plane(lease_s=3.0)
        stack.start_worker("a-flaky", *FAST, "--sim-fail-prob", "1")
        stack.start_worker("b-steady", *FAST)
        stack.start_gateway("--policy", str(policy))
        yield stack
    finally:
        stack.stop_all()


def client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, timeout=30,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def chat(http: httpx.Client, **headers: str) -> httpx.Response:
    return http.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})


def metric(stack: Stack, line_prefix: str) -> float:
    for line in stack.gateway_metrics().splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def generations(stack: Stack, worker_id: str) -> int:
    return int(stack.worker_status(worker_id)["generations_total"])


def test_failures_before_first_token_are_retried_invisibly_and_open_the_breaker(
        stack: Stack, tmp_path: Path) -> None:
    with client(stack) as http:
        for _ in range(6):
            response = chat(http)
            assert response.status_code == 200
            assert response.headers["x-hedgerow-worker"] == "b-steady"
            assert response.text.rstrip().endswith("data: [DONE]")
        assert metric(stack, "hedgerow_retries_total") >= 2
        assert metric(stack, 'hedgerow_breaker_transitions_total{to="open"}') >= 1
        assert metric(stack, 'hedgerow_breaker_state{state="open",worker="a-flaky"}') == 1
        # While open, the flaky worker gets no traffic at all.
        tried = generations(stack, "a-flaky")
        for _ in range(4):
            assert chat(http).status_code == 200
        assert generations(stack, "a-flaky") == tried

        # The worker recovers (restarted healthy under the same id); after
        # open_for_ms a probe goes to it, succeeds, and closes the breaker.
        flaky = next(p for p in stack.procs if p.name == "a-flaky")
        flaky.stop()
        stack.procs.remove(flaky)
        stack.start_worker("a-flaky", *FAST)
        time.sleep(1.6)

        def closed_again() -> bool:
            chat(http)
            return metric(stack, 'hedgerow_breaker_state{state="closed",worker="a-flaky"}') == 1

        wait_for(closed_again, "the breaker to close after a successful probe", timeout=10)
        assert metric(stack, 'hedgerow_breaker_transitions_total{to="closed"}') >= 1


def test_tenant_over_its_concurrency_is_refused_at_the_door(stack: Stack) -> None:
    slow = {"model": MODEL, "stream": True, "max_tokens": 200,
            "messages": [{"role": "user", "content": "tell me everything"}]}
    with client(stack) as http:
        with http.stream("POST", "/v1/chat/completions", json=slow,
                         headers={"authorization": "Bearer sk-tiny"}) as first:
            assert first.status_code == 200
            started = time.monotonic()
            second = chat(http, authorization="Bearer sk-tiny")
            refused_in = time.monotonic() - started
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "concurrency"
    assert int(second.headers["retry-after"]) >= 1
    assert refused_in < 1.0, "a refusal must not wait for anything"


def test_client_deadline_header_is_validated(stack: Stack) -> None:
    with client(stack) as http:
        response = chat(http, **{"x-hedgerow-deadline-ms": "soon"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-hedgerow-deadline-ms"
