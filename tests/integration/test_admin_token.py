"""The control plane's admin token, against a real control-plane process and
the real ``hedgerow policy`` / ``hedgerow status`` commands.

With internal mutual TLS (the default) the admin routes want the admin
certificate and, when one is configured, the token too: either alone is not
enough."""

from __future__ import annotations

import datetime
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hedgerow.trust.credentials import TlsContexts
from hedgerow.trust.identity import Identity
from hedgerow.trust.join import JoinOptions, ensure_identity
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
    stack.control_plane_port, stack.join_port = free_port(), free_port()
    proc = stack.spawn("control-plane", "control-plane", "--port", str(stack.control_plane_port),
                       "--policy", str(root / "policy.yaml"), "--admin-token-file",
                       str(root / "token"), *stack.control_plane_args(stack.join_port))
    try:
        stack.wait_control_plane(proc, stack.control_plane_url)
        yield stack, root
    finally:
        stack.stop_all()


def hedgerow(stack: Stack, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "HEDGEROW_ADMIN_TOKEN"}
    env["HEDGEROW_ADMIN_IDENTITY"] = str(stack.admin_identity)
    if token is not None:
        env["HEDGEROW_ADMIN_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "hedgerow.cli", *args,
                           "--control-plane", stack.control_plane_url],
                          capture_output=True, text=True, timeout=30, env=env)


def _gateway_tls(stack: Stack) -> ssl.SSLContext:
    """A gateway's certificate, bought with a join token as a gateway would."""
    with stack.admin(headers={"authorization": f"Bearer {TOKEN}"}) as admin:
        minted = admin.post("/v1/tokens", json={"role": "gateway", "ttl_s": 600})
    assert minted.status_code == 201, minted.text
    creds = ensure_identity(JoinOptions(
        identity=Identity("gateway", "gw-test"), identity_dir=stack.root / "gw-identity",
        control_plane=stack.control_plane_url, join_url=stack.join_url,
        token=minted.json()["token"], ca_file=stack.cluster_ca),
        datetime.datetime.now(datetime.UTC))
    return TlsContexts(creds).client()


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_refuse_a_missing_or_wrong_token_even_to_the_admin_certificate(
        plane: tuple[Stack, Path], method: str, path: str) -> None:
    stack, _ = plane
    with stack.admin() as admin:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                        {"authorization": f"Basic {TOKEN}"}):
            response = admin.request(method, path, headers=headers, content=POLICY.encode())
            assert response.status_code == 401, (headers, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_admin_token"
            assert error["type"] and "Bearer" in error["message"]


def test_the_token_without_the_admin_certificate_is_not_let_in(
        plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    headers = {"authorization": f"Bearer {TOKEN}"}
    no_certificate = ssl.create_default_context(cafile=stack.cluster_ca)
    with pytest.raises(httpx.HTTPError):  # refused in the TLS handshake
        httpx.get(stack.control_plane_url + "/v1/policy", headers=headers, verify=no_certificate)
    as_gateway = httpx.get(stack.control_plane_url + "/v1/policy", headers=headers,
                           verify=_gateway_tls(stack))
    assert as_gateway.status_code == 403, as_gateway.text


def test_the_right_token_is_let_in(plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    with stack.admin(headers={"authorization": f"Bearer {TOKEN}"}) as admin:
        assert admin.get("/v1/policy").json()["text"] == POLICY
        assert admin.post("/v1/policy/validate", content=POLICY.encode()).status_code == 200
        assert admin.get("/v1/status").status_code == 200


def test_worker_and_gateway_routes_need_no_admin_token(plane: tuple[Stack, Path]) -> None:
    stack, _ = plane
    with stack.admin() as admin:
        assert admin.get("/v1/workers").status_code == 200
        with admin.stream("GET", "/v1/policy/watch") as watch:
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
    with stack.admin() as admin:
        admin.get("/v1/policy", headers={"authorization": "Bearer x"})
    log = stack.procs[0].log()
    assert TOKEN not in log
    assert "unauthenticated" not in log


def test_with_mutual_tls_and_no_token_it_binds_where_asked_and_wants_the_certificate(
        tmp_path: Path) -> None:
    # Every route needs a certificate from the cluster CA: the loopback-only rule
    # for a token-less admin API is for --insecure-internal (below) only.
    stack = Stack(tmp_path)
    port = free_port()
    env_token = os.environ.pop("HEDGEROW_ADMIN_TOKEN", None)
    try:
        proc = stack.spawn("open-plane", "control-plane", "--host", "0.0.0.0", "--port", str(port),
                           *stack.control_plane_args(free_port()))
        url = f"https://127.0.0.1:{port}"
        stack.wait_control_plane(proc, url)
        with stack.admin(url) as admin:
            assert admin.get("/v1/policy").status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/v1/policy", verify=ssl.create_default_context(cafile=stack.cluster_ca))
        log = proc.log()
        assert f"listening on https://0.0.0.0:{port} (mutual TLS)" in log
        assert "unauthenticated" not in log
    finally:
        stack.stop_all()
        if env_token is not None:
            os.environ["HEDGEROW_ADMIN_TOKEN"] = env_token


def test_insecure_internal_without_a_token_warns_and_listens_on_loopback_only(
        tmp_path: Path) -> None:
    stack = Stack(tmp_path, insecure=True)
    port = free_port()
    env_token = os.environ.pop("HEDGEROW_ADMIN_TOKEN", None)
    try:
        proc = stack.spawn("open-plane", "control-plane", "--host", "0.0.0.0", "--port", str(port),
                           *stack.control_plane_args(free_port()))
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
