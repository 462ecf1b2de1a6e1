"""The control plane's admin API on a listener of its own (``--admin-port``),
against a real control-plane process, a real worker and the real CLI.

Split, the main port serves workers and gateways only and answers every admin
route (and ``/metrics``) 404 like any unknown path, even to the admin; the
admin port serves the admin routes (the admin credential, and the token when
one is set), ``/metrics`` behind the metrics or the admin token, and nothing of
the workers' or gateways'. Both are mutual TLS: no certificate, no answer.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        return f"https://127.0.0.1:{self.admin_port}"

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """As the admin (the control plane's admin credential)."""
        return httpx.request(method, url, verify=self.stack.admin_tls(), **kwargs)


def _join_token(plane: Plane, role: str) -> Path:
    """A join token minted on the admin port (the main port has no /v1/tokens)."""
    reply = plane.request("POST", plane.admin + "/v1/tokens", json={"role": role, "ttl_s": 600},
                          headers={"authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 201, reply.text
    path = plane.root / f"{role}.token"
    path.write_text(reply.json()["token"])
    return path


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    root = tmp_path_factory.mktemp("admin-listener")
    (root / "policy.yaml").write_text(POLICY)
    (root / "token").write_text(f"{TOKEN}\n")
    (root / "metrics-token").write_text(f"{METRICS_TOKEN}\n")
    stack = Stack(root)
    stack.control_plane_port, stack.join_port = free_port(), free_port()
    plane = Plane(stack, root, free_port())
    proc = stack.spawn("control-plane", "control-plane", "--port", str(stack.control_plane_port),
                       "--admin-port", str(plane.admin_port), "--lease-s", "2",
                       "--policy", str(root / "policy.yaml"), "--admin-token-file",
                       str(root / "token"), "--metrics-token-file", str(root / "metrics-token"),
                       *stack.control_plane_args(stack.join_port))
    try:
        stack.wait_control_plane(proc, plane.main)
        stack.wait_control_plane(proc, plane.admin)
        # The worker joins and registers and heartbeats on the main port.
        worker = stack.spawn("sim-1", "worker", "--control-plane", plane.main,
                             "--worker-id", "sim-1", "--state-dir", str(root / "state"),
                             "--join-url", stack.join_url, "--join-token-file",
                             str(_join_token(plane, "worker")), "--ca-file",
                             str(stack.cluster_ca), *SIM)
        wait_for(lambda: stack.worker("sim-1") is not None or worker.popen.poll() is not None,
                 "worker sim-1 to register")
        assert worker.popen.poll() is None, worker.log()
        yield plane
    finally:
        stack.stop_all()


def hedgerow(*args: str, env_extra: dict[str, str] | None = None, admin_identity: Path | None = None,
             ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HEDGEROW_ADMIN_TOKEN", "HEDGEROW_ADMIN_URL", "HEDGEROW_CONTROL_PLANE",
                        "HEDGEROW_ADMIN_IDENTITY")}
    env.update({"HEDGEROW_ADMIN_TOKEN": TOKEN, **(env_extra or {})})
    if admin_identity is not None:
        env["HEDGEROW_ADMIN_IDENTITY"] = str(admin_identity)
    return subprocess.run([sys.executable, "-m", "hedgerow.cli", *args],
                          capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize(("method", "path"), [*ADMIN_ROUTES, ("GET", "/metrics")])
def test_the_main_port_answers_admin_routes_404_even_to_the_admin_with_the_token(
        plane: Plane, method: str, path: str) -> None:
    response = plane.request(method, plane.main + path, content=POLICY.encode(),
                             headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_the_admin_port_wants_the_token_besides_the_admin_certificate(
        plane: Plane, method: str, path: str) -> None:
    response = plane.request(method, plane.admin + path, content=POLICY.encode())
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_admin_token"


def test_neither_port_answers_without_a_client_certificate(plane: Plane) -> None:
    only_server_auth = ssl.create_default_context(cafile=plane.stack.cluster_ca)
    headers = {"authorization": f"Bearer {TOKEN}"}
    for url in (plane.main + "/healthz", plane.admin + "/healthz", plane.admin + "/v1/policy"):
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=only_server_auth, headers=headers)
    with pytest.raises(httpx.HTTPError):  # nor over plain HTTP
        httpx.get(plane.admin.replace("https:", "http:") + "/v1/policy", headers=headers)


def test_the_admin_port_serves_the_admin_api_with_the_token(plane: Plane) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert plane.request("GET", plane.admin + "/v1/policy", headers=headers).json()["text"] == POLICY
    assert plane.request("POST", plane.admin + "/v1/policy/validate", content=POLICY.encode(),
                         headers=headers).status_code == 200
    status = plane.request("GET", plane.admin + "/v1/status", headers=headers)
    assert status.status_code == 200
    assert [w["worker_id"] for w in status.json()["workers"]] == ["sim-1"]


def test_workers_and_gateways_stay_on_the_main_port_only(plane: Plane) -> None:
    # The worker registered there and keeps its lease (2 s) by heartbeats.
    assert plane.stack.worker("sim-1") is not None
    verify = plane.stack.admin_tls()
    with httpx.stream("GET", plane.main + "/v1/watch", verify=verify) as watch:
        assert watch.status_code == 200
    with httpx.stream("GET", plane.main + "/v1/policy/watch", verify=verify) as watch:
        assert watch.status_code == 200
    for method, path in (("GET", "/v1/workers"), ("POST", "/v1/workers"), ("GET", "/v1/watch"),
                         ("POST", "/v1/workers/sim-1/heartbeat"),
                         ("POST", "/v1/gateways/g/policy"), ("POST", "/v1/certificates/renew")):
        response = plane.request(method, plane.admin + path, content=b"{}")
        assert response.status_code == 404, (path, response.status_code)
    # There it is the admin route /v1/policy/{version}, not the open watch stream.
    assert plane.request("GET", plane.admin + "/v1/policy/watch").status_code == 401


def test_metrics_are_on_the_admin_port_for_the_metrics_or_the_admin_token(
        plane: Plane) -> None:
    url = plane.admin + "/metrics"
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": METRICS_TOKEN}):
        refused = plane.request("GET", url, headers=headers)
        assert refused.status_code == 401, headers
        assert refused.json()["error"]["code"] == "invalid_metrics_token"
    for token in (METRICS_TOKEN, TOKEN):
        scraped = plane.request("GET", url, headers={"authorization": f"Bearer {token}"})
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        assert "hedgerow_control_plane_workers 1.0" in scraped.text
    # The metrics token is read-only: it opens no admin route.
    for method, path in ADMIN_ROUTES:
        response = plane.request(method, plane.admin + path, content=POLICY.encode(),
                                 headers={"authorization": f"Bearer {METRICS_TOKEN}"})
        assert response.status_code == 401, (method, path)
    # Nor does it stand in for a client certificate.
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, headers={"authorization": f"Bearer {METRICS_TOKEN}"},
                  verify=ssl.create_default_context(cafile=plane.stack.cluster_ca))


def test_the_cli_reaches_the_admin_port_by_flag_or_environment(plane: Plane) -> None:
    identity = plane.stack.admin_identity
    by_flag = hedgerow("policy", "show", "--admin-url", plane.admin, admin_identity=identity)
    assert by_flag.returncode == 0, by_flag.stderr
    assert by_flag.stdout == POLICY
    by_env = hedgerow("status", env_extra={"HEDGEROW_ADMIN_URL": plane.admin},
                      admin_identity=identity)
    assert by_env.returncode == 0, by_env.stderr
    assert "sim-1" in by_env.stdout
    # Pointed at the main port, it says where to look instead.
    wrong = hedgerow("policy", "history", "--control-plane", plane.main, admin_identity=identity)
    assert wrong.returncode == 1
    assert "--admin-url" in wrong.stderr and "HEDGEROW_ADMIN_URL" in wrong.stderr
    # Without the admin credential it says where that is.
    lost = hedgerow("policy", "show", "--admin-url", plane.admin,
                    admin_identity=plane.root / "nowhere")
    assert lost.returncode == 2 and "--admin-identity" in lost.stderr


def test_with_mutual_tls_both_listeners_bind_where_asked_even_without_a_token(
        tmp_path: Path) -> None:
    # Every route needs a certificate from the cluster CA, so the loopback-only
    # rule of a token-less admin API (plain HTTP only) does not apply.
    stack = Stack(tmp_path)
    port, admin_port = free_port(), free_port()
    env_token = os.environ.pop("HEDGEROW_ADMIN_TOKEN", None)
    try:
        proc = stack.spawn("open-plane", "control-plane", "--host", "0.0.0.0",
                           "--port", str(port), "--admin-port", str(admin_port),
                           "--admin-host", "0.0.0.0", *stack.control_plane_args(free_port()))
        stack.wait_control_plane(proc, f"https://127.0.0.1:{admin_port}")
        with stack.admin(f"https://127.0.0.1:{admin_port}") as admin:
            assert admin.get("/v1/policy").status_code == 200
        log = proc.log()
        assert f"listening on https://0.0.0.0:{port} (mutual TLS)" in log
        assert f"admin API listening on https://0.0.0.0:{admin_port}" in log
        assert "instead of 0.0.0.0" not in log
    finally:
        stack.stop_all()
        if env_token is not None:
            os.environ["HEDGEROW_ADMIN_TOKEN"] = env_token


def test_insecure_internal_without_a_token_keeps_only_the_admin_listener_on_loopback(
        tmp_path: Path) -> None:
    stack = Stack(tmp_path, insecure=True)
    port, admin_port = free_port(), free_port()
    env_token = os.environ.pop("HEDGEROW_ADMIN_TOKEN", None)
    try:
        proc = stack.spawn("open-plane", "control-plane", "--host", "0.0.0.0",
                           "--port", str(port), "--admin-port", str(admin_port),
                           "--admin-host", "0.0.0.0", *stack.control_plane_args(free_port()))
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
                     control_plane_port=8500, state_dir=Path("state"), admin_port=8502)
    command = stack.commands()["control-plane"]
    assert command[command.index("--admin-port") + 1] == "8502"
    text = banner(stack, Path("/x/ca.pem"))
    assert "HEDGEROW_ADMIN_URL=https://127.0.0.1:8502" in text
    unsplit = Launched(python=sys.executable, host="127.0.0.1", gateway_port=8443,
                       control_plane_port=8500, state_dir=Path("state"))
    assert "--admin-port" not in unsplit.commands()["control-plane"]
    assert "admin API" not in banner(unsplit, Path("/x/ca.pem"))
