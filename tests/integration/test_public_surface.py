"""What a gateway's public port serves, and what it does without a policy.

Real gateway processes pointed at a control plane that is not there (a free
port nobody listens on):

- following the control plane (no ``--policy``), the gateway serves nobody
  under a built-in default: the client API answers 503 ``policy_unavailable``
  with Retry-After and ``/readyz`` is not ready, until the control plane comes
  up and its policy arrives; then the same gateway serves;
- pinned (``--policy FILE``), it serves that policy at once;
- the public port serves the client API, the page, ``/healthz`` and ``/readyz``
  only: ``/metrics`` and the admin routes are 404 there and live on the admin
  listener, ``/metrics`` behind the metrics or the admin token.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.stack import Stack, free_port, scrape_metrics, wait_for

pytestmark = pytest.mark.e2e

MODEL = "pinned-model"
APP_ORIGIN = "https://app.example.com"
ADMIN_TOKEN = "gw-admin-token-5d0c2a"
METRICS_TOKEN = "gw-metrics-token-81be47"
PINNED = f"""
classes:
  - {{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}}
tenants:
  - {{name: local, class: interactive}}
anonymous_tenant: local
models:
  - name: {MODEL}
cors:
  allow_origins: ["{APP_ORIGIN}"]
"""
SIM = ["--backend", "sim", "--slots", "2", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "2", "--sim-output-tokens", "4"]
CHAT = {"model": "smollm2-135m-instruct", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]}


def _client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, timeout=10,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def _dead_control_plane(root: Path) -> Stack:
    # Plain internal HTTP: a gateway that never met a control plane has no identity
    # and cannot join one that is down; what is tested here is the policy it serves
    # and its public surface (internal trust has tests of its own).
    stack = Stack(root, insecure=True)
    stack.control_plane_port = free_port()  # nothing listens there (yet)
    return stack


def test_without_a_policy_the_client_api_is_503_until_the_control_plane_sends_one(
        tmp_path: Path) -> None:
    stack = _dead_control_plane(tmp_path)
    try:
        stack.start_gateway(wait_ready=False)
        with _client(stack) as http:
            for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                 ("GET", "/v1/models")):
                body = CHAT if path.endswith("chat/completions") else {
                    "model": CHAT["model"], "prompt": "hi"}
                refused = http.request(method, path, json=body if method == "POST" else None)
                assert refused.status_code == 503, (path, refused.text)
                error = refused.json()["error"]
                assert (error["code"], error["type"]) == ("policy_unavailable",
                                                          "service_unavailable")
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.headers["x-request-id"]
            ready = http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["policy"] is False
            assert http.get("/healthz").status_code == 200
            assert http.get("/").status_code == 200  # the page itself needs no policy

            # The control plane comes up (with a worker): its policy arrives, and
            # the same gateway now serves.
            stack.spawn("control-plane", "control-plane", "--port",
                        str(stack.control_plane_port), "--lease-s", "2",
                        *stack.control_plane_args(free_port()))
            wait_for(lambda: httpx.get(stack.control_plane_url + "/healthz").status_code == 200,
                     "the control plane")
            stack.start_worker("sim-1", *SIM)
            wait_for(lambda: http.get("/readyz").status_code == 200, "the gateway ready", 15)
            assert http.get("/readyz").json()["policy"] is True
            served = http.post("/v1/chat/completions", json=CHAT)
            assert served.status_code == 200, served.text
            assert served.json()["choices"][0]["message"]["content"]
    finally:
        stack.stop_all()
    assert "the client API answers 503 until the first version arrives" in next(
        p for p in stack.procs if p.name == "gateway").log()


@pytest.fixture(scope="module")
def pinned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("pinned")
    (root / "policy.yaml").write_text(PINNED)
    (root / "admin-token").write_text(ADMIN_TOKEN)
    (root / "metrics-token").write_text(METRICS_TOKEN + "\n")
    stack = _dead_control_plane(root)
    try:
        stack.start_gateway("--policy", str(root / "policy.yaml"),
                            "--admin-token-file", str(root / "admin-token"),
                            "--metrics-token-file", str(root / "metrics-token"),
                            wait_ready=False)
        yield stack
    finally:
        stack.stop_all()


def test_a_pinned_policy_is_served_without_the_control_plane(pinned: Stack) -> None:
    with _client(pinned) as http:
        models = http.get("/v1/models")
        assert models.status_code == 200
        # The chat model only: the pinned policy leaves the semantic cache off (the
        # default), so the gateway runs no embedding model to list.
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        # Admitted under the pinned policy; only the workers are missing.
        refused = http.post("/v1/chat/completions", json={**CHAT, "model": MODEL})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "no_healthy_worker"
        ready = http.get("/readyz").json()
        assert ready["policy"] is True and ready["workers"] == 0


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/metrics"), ("HEAD", "/metrics"), ("GET", "/admin/cache"),
    ("POST", "/admin/cache/purge"), ("GET", "/v1/status"), ("GET", "/v1/workers"),
    ("GET", "/v1/watch"), ("GET", "/v1/policy"), ("GET", "/status"),
])
def test_the_public_port_answers_internal_paths_404(pinned: Stack, method: str,
                                                    path: str) -> None:
    with _client(pinned) as http:
        response = http.request(method, path,
                                headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 404, (method, path, response.text)
    if method != "HEAD":
        assert response.json()["error"]["code"] == "not_found"


def test_a_browser_preflight_for_metrics_is_404_too(pinned: Stack) -> None:
    """From an origin the policy allows, which would get 204 for the client API."""
    with _client(pinned) as http:
        assert http.options("/v1/chat/completions", headers={
            "origin": APP_ORIGIN, "access-control-request-method": "POST"}).status_code == 204
        response = http.options("/metrics", headers={
            "origin": APP_ORIGIN, "access-control-request-method": "GET"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_gateway_metrics_are_on_the_admin_port_for_the_metrics_or_the_admin_token(
        pinned: Stack) -> None:
    url = pinned.gateway_admin_url + "/metrics"
    for headers in ({}, {"authorization": "Bearer nope"}):
        refused = httpx.get(url, headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_metrics_token"
    for token in (METRICS_TOKEN, ADMIN_TOKEN):
        text = scrape_metrics(pinned.gateway_admin_url, token)
        assert "hedgerow_connections_limit" in text
    # The metrics token is read-only: the cache admin API refuses it.
    metrics_only = {"authorization": f"Bearer {METRICS_TOKEN}"}
    assert httpx.get(pinned.gateway_admin_url + "/admin/cache",
                     headers=metrics_only).status_code == 401
    assert httpx.post(pinned.gateway_admin_url + "/admin/cache/purge", json={"model": MODEL},
                      headers=metrics_only).status_code == 401
