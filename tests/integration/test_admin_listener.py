"""The control plane's admin API on a listener of its own (``--admin-port``),
against a real control-plane process, a real worker and the real CLI.

Split, the main port serves workers and gateways only and answers every admin
route (and ``/metrics``) 404 like any unknown path; the admin port serves the
admin routes, behind the token, ``/metrics`` behind the metrics or the admin
token, and nothing of the workers' or gateways'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hedgerow.launcher import Stack as Launched
from hedgerow.launcher import banner
from tests.support.stack import Stack, free_port, wait_for

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-admin-token-for-the-admin-listener"
METRICS_TOKEN = "read-only-metrics-token-for-prometheus"
POLICY = """\
classes:
  - {name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}
tenants:
  - {name: local, class: interactive}
anonymous_tenant: local
"""
ADMIN_ROUTES = [  # as tests/integration/test_admin_token.py
    ("GET", "/v1/policy"), ("GET", "/v1/policy/1"), ("GET", "/v1/policy/history"),
    ("POST", "/v1/policy"), ("POST", "/v1/policy/validate"), ("POST", "/v1/policy/rollback/1"),
    ("GET", "/v1/status"), ("GET", "/v1/upstreams"), ("POST", "/v1/upstreams"),
    ("DELETE", "/v1/upstreams/x"),
]

SIM = ["--backend", "sim", "--slots", "1"]


class Plane:
    def __init__(self, stack: Stack, root: Path, admin_port: int) -> None:
        self.stack, self.root, self.admin_port = stack, root, admin_port

    @property
    def main(self) -> str:
        return self.stack.control_plane_url

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    root = tmp_path_factory.mktemp("admin-listener")
    (root / "policy.yaml").write_text(POLICY)
    (root / "token").write_text(f"{TOKEN}\n")
    (root / "metrics-token").write_text(f"{METRICS_TOKEN}\n")
    stack = Stack(root)
    stack.control_plane_port = free_port()
    plane = Plane(stack, root, free_port())
    stack.spawn("control-plane", "control-plane", "--port", str(stack.control_plane_port),
                "--admin-port", str(plane.admin_port), "--lease-s", "2",
                "--policy", str(root / "policy.yaml"), "--admin-token-file", str(root / "token"),
                "--metrics-token-file", str(root / "metrics-token"))
    try:
        for url in (plane.main, plane.admin):
            wait_for(lambda: httpx.get(url + "/healthz").status_code == 200, "control plane")
        stack.start_worker("sim-1", *SIM)  # registers and heartbeats on the main port
        yield plane
    finally:
        stack.stop_all()


def hedgerow(*args: str, env_extra: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HEDGEROW_ADMIN_TOKEN", "HEDGEROW_ADMIN_URL", "HEDGEROW_CONTROL_PLANE")}
    env.update({"HEDGEROW_ADMIN_TOKEN": TOKEN, **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "hedgerow.cli", *args],
                          capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize(("method", "path"), [*ADMIN_ROUTES, ("GET", "/metrics")])
def test_the_main_port_answers_admin_routes_404_even_with_the_token(
        plane: Plane, method: str, path: str) -> None:
    response = httpx.request(method, plane.main + path, content=POLICY.encode(),
                             headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_the_admin_port_wants_the_token(plane: Plane, method: str, path: str) -> None:
    response = httpx.request(method, plane.admin + path, content=POLICY.encode())
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_admin_token"


def test_the_admin_port_serves_the_admin_api_with_the_token(plane: Plane) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(plane.admin + "/v1/policy", headers=headers).json()["text"] == POLICY
    assert httpx.post(plane.admin + "/v1/policy/validate", content=POLICY.encode(),
                      headers=headers).status_code == 200
    status = httpx.get(plane.admin + "/v1/status", headers=headers)
    assert status.status_code == 200
    assert [w["worker_id"] for w in status.json()["workers"]] == ["sim-1"]


def test_workers_and_gateways_stay_on_the_main_port_only(plane: Plane) -> None:
    # The worker registered there and keeps its lease (2 s) by heartbeats.
    assert plane.stack.worker("sim-1") is not None
    with httpx.stream("GET", plane.main + "/v1/watch") as watch:
        assert watch.status_code == 200
    with httpx.stream("GET", plane.main + "/v1/policy/watch") as watch:
        assert watch.status_code == 200
    for method, path in (("GET", "/v1/workers"), ("POST", "/v1/workers"), ("GET", "/v1/watch"),
                         ("POST", "/v1/workers/sim-1/heartbeat"),
                         ("POST", "/v1/gateways/g/policy")):
        response = httpx.request(method, plane.admin + path, content=b"{}")
        assert response.status_code == 404, (path, response.status_code)
    # There it is the admin route /v1/policy/{version}, not the open watch stream.
    assert httpx.get(plane.admin + "/v1/policy/watch").status_code == 401


def test_metrics_are_on_the_admin_port_for_the_metrics_or_the_admin_token(
        plane: Plane) -> None:
    url = plane.admin + "/metrics"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": METRICS_TOKEN}):
        refused = httpx.get(url, headers=headers)
        assert refused.status_code == 401, headers
        assert refused.json()["error"]["code"] == "invalid_metrics_token"
    for token in (METRICS_TOKEN, TOKEN):
        scraped = httpx.get(url, headers={"authorization": f"Bearer {token}"})
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        assert "hedgerow_control_plane_workers 1.0" in scraped.text
    # The metrics token is read-only: it opens no admin route.
    for method, path in ADMIN_ROUTES:
        response = httpx.request(method, plane.admin + path, content=POLICY.encode(),
                                 headers={"authorization": f"Bearer {METRICS_TOKEN}"})
        assert response.status_code == 401, (method, path)


def test_the_cli_reaches_the_admin_port_by_flag_or_environment(plane: Plane) -> None:
    by_flag = hedgerow("policy", "show", "--admin-url", plane.admin)
    assert by_flag.returncode == 0, by_flag.stderr
    assert by_flag.stdout == POLICY
    by_env = hedgerow("status", env_extra={"HEDGEROW_ADMIN_URL": plane.admin})
    assert by_env.returncode == 0, by_env.stderr
    assert "sim-1" in by_env.stdout
    # Pointed at the main port, it says where to look instead.
    wrong = hedgerow("policy", "history", "--control-plane", plane.main)
    assert wrong.returncode == 1
    assert "--admin-url" in wrong.stderr and "HEDGEROW_ADMIN_URL" in wrong.stderr


def test_without_a_token_only_the_admin_listener_is_kept_on_loopback(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    port, admin_port = free_port(), free_port()
    env_token = os.environ.pop("HEDGEROW_ADMIN_TOKEN", None)
    try:
        proc = stack.spawn("open-plane", "control-plane", "--host", "0.0.0.0",
                           "--port", str(port), "--admin-port", str(admin_port),
                           "--admin-host", "0.0.0.0")
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin_port}/healthz").status_code == 200,
                 "admin listener")
        assert httpx.get(f"http://127.0.0.1:{admin_port}/v1/policy").status_code == 200
        log = proc.log()
        assert f"listening on http://0.0.0.0:{port}" in log
        assert "so listening on 127.0.0.1 instead of 0.0.0.0" in log
        assert f"admin API listening on http://127.0.0.1:{admin_port}" in log
    finally:
        stack.stop_all()
        if env_token is not None:
            os.environ["HEDGEROW_ADMIN_TOKEN"] = env_token


def test_the_same_port_twice_is_refused(tmp_path: Path) -> None:
    port = str(free_port())
    result = hedgerow("control-plane", "--port", port, "--admin-port", port)
    assert result.returncode == 2 and "--admin-port" in result.stderr


def test_hedgerow_up_passes_the_admin_port_and_prints_it() -> None:
    stack = Launched(python=sys.executable, host="127.0.0.1", gateway_port=8443,
                     control_plane_port=8500, state_dir=Path("state"), admin_port=8501)
    command = stack.commands()["control-plane"]
    assert command[command.index("--admin-port") + 1] == "8501"
    text = banner(stack, Path("/x/ca.pem"))
    assert "HEDGEROW_ADMIN_URL=http://127.0.0.1:8501" in text
    unsplit = Launched(python=sys.executable, host="127.0.0.1", gateway_port=8443,
                       control_plane_port=8500, state_dir=Path("state"))
    assert "--admin-port" not in unsplit.commands()["control-plane"]
    assert "admin API" not in banner(unsplit, Path("/x/ca.pem"))
