"""What a gateway's public port serves.

A real gateway process pointed at a control plane that is not there (a free
port nobody listens on):

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

from tests.support.stack import Stack, free_port, scrape_metrics

pytestmark = pytest.mark.e2e

MODEL = "pinned-model"
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
"""


def _client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, timeout=10,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def _dead_control_plane(root: Path) -> Stack:
    stack = Stack(root)
    stack.control_plane_port = free_port()  # nothing listens there (yet)
    return stack


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
