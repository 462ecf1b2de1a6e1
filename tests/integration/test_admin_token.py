"""The control plane's admin token, against a real control-plane process and
the real ``hedgerow policy`` / ``hedgerow status`` commands."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.stack import Stack, free_port, wait_for

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-admin-token-for-tests"
POLICY = """\
classes:
  - {name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}
tenants:
  - {name: local, class: interactive}
anonymous_tenant: local
"""
ADMIN_ROUTES = [
    ("GET", "/v1/policy"), ("GET", "/v1/policy/1"), ("GET", "/v1/policy/history"),
    ("POST", "/v1/policy"), ("POST", "/v1/policy/validate"), ("POST", "/v1/policy/rollback/1"),
    ("GET", "/v1/status"), ("GET", "/v1/upstreams"), ("POST", "/v1/upstreams"),
    ("DELETE", "/v1/upstreams/x"),
]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    root = tmp_path_factory.mktemp("admin")
    (root / "policy.yaml").write_text(POLICY)
    (root / "token").write_text(f"{TOKEN}\n")
    stack = Stack(root)
    stack.control_plane_port = free_port()
    stack.spawn("control-plane", "control-plane", "--port", str(stack.control_plane_port),
                "--policy", str(root / "policy.yaml"), "--admin-token-file", str(root / "token"))
    try:
        wait_for(lambda: httpx.get(stack.control_plane_url + "/healthz").status_code == 200,
                 "control plane")
        yield stack, root
    finally:
        stack.stop_all()


def hedgerow(stack: Stack, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HEDGEROW_ADMIN_TOKEN"}
    if token is not None:
        env["HEDGEROW_ADMIN_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "hedgerow.cli", *args,
                           "--control-plane", stack.control_plane_url],
                          capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_refuse_a_missing_or_wrong_token(
        plane: tuple[Stack, Path], method: str, path: str) -> None:
    stack, _ = plane
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                    {"authorization": f"Basic {TOKEN}"}):
        response = httpx.request(method, stack.control_plane_url + path, headers=headers,
                                 content=POLICY.encode())
        assert response.status_code == 401, (headers, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_admin_token"
        assert error["type"] and "Bearer" in error["message"]


def test_the_right_token_is_let_in(plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    headers = {"authorization": f"Bearer {TOKEN}"}
    base = stack.control_plane_url
    assert httpx.get(base + "/v1/policy", headers=headers).json()["text"] == POLICY
    assert httpx.post(base + "/v1/policy/validate", content=POLICY.encode(),
                      headers=headers).status_code == 200
    assert httpx.get(base + "/v1/status", headers=headers).status_code == 200


def test_worker_and_gateway_routes_stay_open(plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    assert httpx.get(stack.control_plane_url + "/v1/workers").status_code == 200
    with httpx.stream("GET", stack.control_plane_url + "/v1/policy/watch") as watch:
        assert watch.status_code == 200


def test_cli_sends_the_token_from_the_environment_or_a_file(plane: tuple[Stack, Path]) -> None:
    stack, root = plane
    shown = hedgerow(stack, "policy", "show", token=TOKEN)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == POLICY
    assert hedgerow(stack, "status", token=TOKEN).returncode == 0
    from_file = hedgerow(stack, "policy", "history", "--admin-token-file", str(root / "token"))
    assert from_file.returncode == 0, from_file.stderr

    refused = hedgerow(stack, "policy", "show")
    assert refused.returncode == 1
    assert "HEDGEROW_ADMIN_TOKEN" in refused.stderr
    assert hedgerow(stack, "policy", "show", token="wrong").returncode == 1


def test_the_token_is_never_logged(plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    httpx.get(stack.control_plane_url + "/v1/policy", headers={"authorization": "Bearer x"})
    log = stack.procs[0].log()
    assert TOKEN not in log
    assert "unauthenticated" not in log


def test_without_a_token_the_control_plane_warns_and_listens_on_loopback_only(
        tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    port = free_port()
    env_token = os.environ.pop("HEDGEROW_ADMIN_TOKEN", None)
    try:
        proc = stack.spawn("open-plane", "control-plane", "--host", "0.0.0.0", "--port", str(port))
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200,
                 "control plane")
        assert httpx.get(f"http://127.0.0.1:{port}/v1/policy").status_code == 200
        log = proc.log()
        assert "admin API would be unauthenticated, so listening on 127.0.0.1" in log
        assert f"listening on http://127.0.0.1:{port}" in log
    finally:
        stack.stop_all()
        if env_token is not None:
            os.environ["HEDGEROW_ADMIN_TOKEN"] = env_token
