"""Hedgerow's processes on a Redis that requires TLS, a client certificate and an ACL user.

A real ``redis-server`` with ``tls-auth-clients yes``, ``user default off``
and the ``hedgerow`` user docs/deployment.md gives; a control plane, a
simulated worker and two gateways started as an operator would, with
``--redis rediss://hedgerow:PASSWORD@...`` and ``--redis-ca-file``,
``--redis-cert-file``, ``--redis-key-file``. What a user notices: the
registry lives in that Redis, an answer generated through one gateway is an
exact hit on the other, a tenant's request limit holds across both, and no
process ever logs the password. A control plane that does not trust the
server's CA and a gateway with a wrong password stop at once with a message
that says what to fix.
"""

from __future__ import annotations

import hashlib
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
import trustme

from hedgerow.redis_conn import open_redis
from tests.support.redis_tls import TlsRedisServer, mtls_redis_server
from tests.support.stack import Proc, Stack, free_port, wait_for

__all__ = ["mtls_redis_server"]

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
METERED_KEY = "sk-metered-tls-5e1c"
SIM = ["--backend", "sim", "--slots", "4", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-jitter", "0", "--sim-output-tokens", "4"]
POLICY = f"""
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 5000, deadline_ms: 20000}}
tenants:
  - name: local
    class: interactive
  - name: metered
    class: interactive
    api_key_sha256: ["{hashlib.sha256(METERED_KEY.encode()).hexdigest()}"]
    limits: {{requests_per_s: 0.01, requests_burst: 1}}
models:
  - name: {MODEL}
cache:
  semantic: {{enabled: false}}
"""
EXIT_S = 20.0  # a refused start ends well within this (the interpreter's start included)


@dataclass
class TlsStack:
    stack: Stack
    redis: TlsRedisServer
    urls: tuple[str, str]


def _start_control_plane(stack: Stack, *redis_args: str) -> Proc:
    stack.control_plane_port = free_port()
    stack.join_port = free_port()
    proc = stack.spawn("control-plane", "control-plane", "--port", str(stack.control_plane_port),
                       "--lease-s", "2", *redis_args, *stack.control_plane_args(stack.join_port))
    stack.wait_control_plane(proc, stack.control_plane_url)
    return proc


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory,
              mtls_redis_server: TlsRedisServer) -> Iterator[TlsStack]:
    root = tmp_path_factory.mktemp("redis-tls-e2e")
    (root / "policy.yaml").write_text(POLICY)
    redis = mtls_redis_server
    redis_args = ["--redis", redis.url, *redis.tls_args()]
    stack = Stack(root)
    try:
        _start_control_plane(stack, *redis_args)
        stack.start_worker("sim-1", *SIM)
        urls = []
        for name in ("a", "b"):
            stack.start_gateway("--policy", str(root / "policy.yaml"), "--gateway-id",
                                f"gw-{name}", *redis_args)
            urls.append(stack.gateway_url)
        yield TlsStack(stack, redis, (urls[0], urls[1]))
    finally:
        stack.stop_all()


def _client(stack: TlsStack, url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10,
                        verify=ssl.create_default_context(cafile=stack.stack.ca_cert))


def _chat(http: httpx.Client, content: str, key: str | None = None) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return http.post("/v1/chat/completions", json=body, headers=headers)


async def _workers_in_redis(redis: TlsRedisServer) -> set[bytes]:
    client = open_redis(redis.url, redis.tls, socket_timeout=2, connect_timeout=2)
    try:
        return set(await client.smembers("hedgerow:workers"))  # type: ignore[misc]
    finally:
        await client.aclose()


def test_the_control_plane_keeps_its_registry_in_the_tls_redis(tls_stack: TlsStack) -> None:
    assert anyio.run(_workers_in_redis, tls_stack.redis) == {b"sim-1"}
    assert tls_stack.stack.worker("sim-1") is not None


def test_an_answer_from_one_gateway_is_a_cache_hit_on_the_other(tls_stack: TlsStack) -> None:
    with _client(tls_stack, tls_stack.urls[0]) as a, _client(tls_stack, tls_stack.urls[1]) as b:
        first = _chat(a, "What colour is a tangerine heron?")
        assert first.status_code == 200, first.text
        assert first.headers["x-hedgerow-cache"] == "miss"
        # Stored just after it was sent: poll rather than sleep.
        wait_for(lambda: _chat(b, "What colour is a tangerine heron?").headers.get(
            "x-hedgerow-cache") == "exact", "the answer to reach gw-b through Redis", timeout=10)
        again = _chat(b, "What colour is a tangerine heron?")
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


def test_a_tenants_request_limit_holds_across_both_gateways(tls_stack: TlsStack) -> None:
    with _client(tls_stack, tls_stack.urls[0]) as a, _client(tls_stack, tls_stack.urls[1]) as b:
        assert _chat(a, "one", METERED_KEY).status_code == 200
        refused = _chat(b, "two", METERED_KEY)  # a burst of one, shared through Redis
        assert refused.status_code == 429, refused.text
        assert "shared by all gateways" in refused.json()["error"]["message"]


def test_no_process_logs_the_password(tls_stack: TlsStack) -> None:
    logs = {proc.name: proc.log() for proc in tls_stack.stack.procs}
    assert all(tls_stack.redis.password not in text for text in logs.values())
    # ...and yet each Redis user says where it is connected, redacted.
    for name in ("control-plane", "gateway"):
        assert f"hedgerow:***@127.0.0.1:{tls_stack.redis.port}" in logs[name], logs[name]


def _refused_start(stack: Stack, name: str, *args: str) -> tuple[int, str]:
    proc = stack.spawn(name, *args)
    started = time.monotonic()
    try:
        code = proc.popen.wait(EXIT_S)
    finally:
        proc.stop(timeout=5)
    assert time.monotonic() - started < EXIT_S
    return code, proc.log()


def test_a_control_plane_that_does_not_trust_the_ca_stops_with_a_clear_error(
        tmp_path: Path, mtls_redis_server: TlsRedisServer) -> None:
    redis = mtls_redis_server
    stranger = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger))
    code, log = _refused_start(
        Stack(tmp_path), "control-plane", "control-plane", "--port", str(free_port()),
        "--state-dir", str(tmp_path / "control-plane"), "--join-port", str(free_port()),
        "--redis", redis.url, "--redis-ca-file", str(stranger),
        "--redis-cert-file", str(redis.client_cert), "--redis-key-file", str(redis.client_key))
    assert code == 1, log
    assert "certificate is not trusted" in log and str(stranger) in log
    assert redis.password not in log and "Traceback" not in log


def test_a_gateway_with_a_wrong_password_stops_with_a_clear_error(
        tmp_path: Path, tls_stack: TlsStack) -> None:
    redis = tls_stack.redis
    # It joins the cluster first, so what stops it is Redis alone.
    code, log = _refused_start(
        Stack(tmp_path), "gateway", "gateway", "--port", str(free_port()),
        "--state-dir", str(tmp_path / "state"),
        "--control-plane", tls_stack.stack.control_plane_url,
        *tls_stack.stack.join_args("gateway"),
        "--redis", redis.url_for(password="not-the-password-77"), *redis.tls_args())
    assert code == 1, log
    assert "authentication refused" in log and "hedgerow:***@" in log
    assert "not-the-password-77" not in log and "Traceback" not in log
