"""Internal trust with real processes: who may reach the control plane and
workers, who may act as whom, revocation, and certificate rotation under
live streams. The stack is the production CLI (``bench.stack.Stack``): the
control plane makes its CA, join tokens are minted through the admin API,
and the simulated workers and the gateway join with them.
"""

from __future__ import annotations

import datetime
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from hedgerow.trust.ca import ClusterCA
from hedgerow.trust.credentials import Credentials
from hedgerow.trust.identity import Identity

from tests.support.stack import Stack, free_port, wait_for
from tests.support.streams import chat_body, client

pytestmark = pytest.mark.e2e

SIM = ("--backend", "sim", "--no-warm-up")
OUTSIDER_BODY = {"worker_id": "evil", "url": "https://127.0.0.1:9", "kind": "cpu",
                 "models": ["smollm2-135m-instruct"], "slots": 1024}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("trust"))
    try:
        stack.start_control_plane(lease_s=2.0)
        stack.start_worker("sim-a", *SIM)
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


def identity_dir(stack: Stack, role: str, name: str) -> Path:
    return stack.root / "state" / f"identity-{role}-{name}"


def as_identity(stack: Stack, directory: Path, *, check_hostname: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=stack.cluster_ca)
    context.check_hostname = check_hostname
    context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    return context


def outsider_contexts(stack: Stack, tmp_path: Path) -> dict[str, ssl.SSLContext]:
    """TLS that trusts the cluster CA but holds no certificate, and TLS with a
    certificate from another CA that claims to be a worker."""
    no_cert = ssl.create_default_context(cafile=stack.cluster_ca)
    now = datetime.datetime.now(datetime.UTC)
    rogue = ClusterCA.load_or_create(tmp_path / "rogue-ca", now)  # the same shape, not ours
    key = ec.generate_private_key(ec.SECP256R1())
    forged = rogue.issue(key.public_key(), Identity("worker", "sim-a"),
                         lifetime=datetime.timedelta(hours=1), now=now)
    Credentials(tmp_path / "forged").write_issued(key, forged, rogue.cert)
    forged_ctx = ssl.create_default_context(cafile=stack.cluster_ca)
    forged_ctx.load_cert_chain(tmp_path / "forged" / "cert.pem", tmp_path / "forged" / "key.pem")
    return {"no certificate": no_cert, "another CA's certificate": forged_ctx}


CONTROL_PLANE_CALLS = [
    ("POST", "/v1/workers", OUTSIDER_BODY),
    ("POST", "/v1/workers/sim-a/heartbeat", {"load": {"active": 0}}),
    ("DELETE", "/v1/workers/sim-a", None),
    ("GET", "/v1/workers", None),
    ("GET", "/v1/watch", None),
    ("GET", "/v1/policy/watch", None),
    ("GET", "/v1/policy", None),
    ("POST", "/v1/tokens", {"role": "worker"}),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize(("method", "path", "body"), CONTROL_PLANE_CALLS)
def test_an_outsider_reaches_nothing_on_the_control_plane(
        stack: Stack, tmp_path: Path, method: str, path: str, body: Any) -> None:
    plain = f"http://127.0.0.1:{stack.control_plane_port}{path}"
    with pytest.raises(httpx.HTTPError):  # plain HTTP: the TLS listener hangs up
        httpx.request(method, plain, json=body, timeout=5)
    for what, context in outsider_contexts(stack, tmp_path).items():
        with pytest.raises(httpx.HTTPError), httpx.Client(verify=context, timeout=5) as c:
            reply = c.request(method, stack.control_plane_url + path, json=body)
            pytest.fail(f"{what}: {method} {path} answered {reply.status_code}")
    assert stack.worker("sim-a") is not None and stack.worker("evil") is None


def test_an_outsider_cannot_call_a_worker_and_neither_can_another_worker(
        stack: Stack, tmp_path: Path) -> None:
    url = stack.worker("sim-a")["registration"]["url"]  # type: ignore[index]
    assert url.startswith("https://")
    body = chat_body(4)
    with pytest.raises(httpx.HTTPError):
        httpx.post(url.replace("https:", "http:") + "/v1/chat/completions", json=body, timeout=5)
    for context in outsider_contexts(stack, tmp_path).values():
        context.check_hostname = False
        with pytest.raises(httpx.HTTPError):
            httpx.post(url + "/v1/chat/completions", json=body, verify=context, timeout=5)
    # A worker's own certificate is valid, but workers serve only gateways.
    worker = as_identity(stack, identity_dir(stack, "worker", "sim-a"), check_hostname=False)
    reply = httpx.post(url + "/v1/chat/completions", json=body, verify=worker, timeout=5)
    assert reply.status_code == 403
    assert reply.json()["error"]["type"] == "permission_error"


def test_a_worker_acts_only_as_itself(stack: Stack) -> None:
    worker = as_identity(stack, identity_dir(stack, "worker", "sim-a"))
    with httpx.Client(base_url=stack.control_plane_url, verify=worker, timeout=5) as c:
        stolen = dict(OUTSIDER_BODY, worker_id="sim-b", url="https://127.0.0.1:9")
        assert c.post("/v1/workers", json=stolen).status_code == 403
        assert c.post("/v1/workers/sim-b/heartbeat", json={"load": {}}).status_code == 403
        assert c.delete("/v1/workers/sim-b").status_code == 403
        # Its own id but a plaintext URL: gateways call workers over mutual TLS only.
        plain = dict(OUTSIDER_BODY, worker_id="sim-a", url="http://127.0.0.1:9")
        refused = c.post("/v1/workers", json=plain)
        assert refused.status_code == 400 and "https" in refused.json()["error"]["message"]
        # Workers cannot read the registry or the policy.
        assert c.get("/v1/workers").status_code == 403
        assert c.get("/v1/policy/watch").status_code == 403
    assert stack.worker("sim-a")["registration"]["url"].startswith("https://127.0.0.1:")  # type: ignore[index]


def test_a_joined_name_cannot_be_taken_by_another_joiner(stack: Stack, tmp_path: Path) -> None:
    with stack.admin() as admin:
        token = admin.post("/v1/tokens", json={"role": "worker"}).json()["token"]
    token_file = tmp_path / "other.token"
    token_file.write_text(token)
    proc = stack.spawn("thief", "worker", "--control-plane", stack.control_plane_url,
                       "--worker-id", "sim-a", "--state-dir", str(tmp_path), *SIM,
                       "--join-url", stack.join_url, "--join-token-file", str(token_file),
                       "--ca-file", str(stack.cluster_ca))
    assert proc.popen.wait(30) == 1
    assert "409" in proc.log() and "is held by a joiner" in proc.log()


def test_a_wrong_ca_pin_is_refused_before_the_token_is_sent(stack: Stack, tmp_path: Path) -> None:
    token_file = tmp_path / "w.token"
    token = Path(stack.join_args("worker")[3]).read_text()  # a valid token: only the pin is wrong
    token_file.write_text(token)
    proc = stack.spawn("pinned-wrong", "worker", "--control-plane", stack.control_plane_url,
                       "--worker-id", "sim-pin", "--state-dir", str(tmp_path), *SIM,
                       "--join-url", stack.join_url, "--join-token-file", str(token_file),
                       "--ca-pin", "sha256:" + "0" * 64)
    assert proc.popen.wait(30) == 1
    assert "does not match --ca-pin" in proc.log()
    assert not (tmp_path / "identity-worker-sim-pin").exists()


def test_a_worker_joins_with_the_ca_pin_that_token_create_prints(
        stack: Stack, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "hedgerow.cli", "token", "create", "--role",
                           "worker", "--ttl", "10m", "--name", "sim-pinned"],
                          capture_output=True, text=True, timeout=30, env=stack.admin_env())
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    assert token.startswith("hjt.") and token.count(".") == 2
    pin = done.stderr.split("--ca-pin ")[1].split()[0]
    proc = stack.spawn("sim-pinned", "worker", "--control-plane", stack.control_plane_url,
                       "--worker-id", "sim-pinned", "--state-dir", str(tmp_path), *SIM,
                       "--join-url", stack.join_url, "--join-token", token, "--ca-pin", pin)
    try:
        wait_for(lambda: stack.worker("sim-pinned") is not None, "the pinned worker")
    finally:
        proc.stop()
    listed = subprocess.run([sys.executable, "-m", "hedgerow.cli", "token", "list"],
                            capture_output=True, text=True, timeout=30, env=stack.admin_env())
    assert "worker/sim-pinned" in listed.stdout and token.split(".")[2] not in listed.stdout


def test_revoking_a_worker_takes_it_out_of_service_within_a_lease(
        stack: Stack, tmp_path: Path) -> None:
    stack.start_worker("sim-doomed", *SIM)
    with stack.admin() as admin:
        reply = admin.post("/v1/identities/revoke", json={"identity": "worker/sim-doomed"})
    assert reply.status_code == 200
    revoked_at = time.monotonic()
    wait_for(lambda: stack.worker("sim-doomed") is None, "the revoked worker to leave", 3.0)
    # Its heartbeats are refused from now on: it stays out well past a lease.
    time.sleep(2.5)
    assert stack.worker("sim-doomed") is None
    assert time.monotonic() - revoked_at < 10
    # ...and its certificate buys nothing on the control plane any more.
    revoked = as_identity(stack, identity_dir(stack, "worker", "sim-doomed"))
    reply = httpx.post(stack.control_plane_url + "/v1/workers/sim-doomed/heartbeat",
                       json={"load": {}}, verify=revoked, timeout=5)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "identity_revoked"
    # Traffic keeps flowing to the workers that are still trusted.
    with client(stack) as http:
        for _ in range(3):
            response = http.post("/v1/chat/completions",
                                 json={**chat_body(4), "stream": False},
                                 headers={"cache-control": "no-cache"})
            assert response.status_code == 200
            assert response.headers["x-hedgerow-worker"] != "sim-doomed"


def test_revoking_a_token_revokes_every_identity_it_bought(stack: Stack, tmp_path: Path) -> None:
    with stack.admin() as admin:
        created = admin.post("/v1/tokens", json={"role": "gateway", "ttl_s": 600}).json()
        (tmp_path / "g.token").write_text(created["token"])
        port = free_port()
        gateway = stack.spawn("gw-revoked", "gateway", "--port", str(port),
                              "--gateway-id", "gw-revoked",
                              "--control-plane", stack.control_plane_url,
                              "--state-dir", str(tmp_path), "--join-url", stack.join_url,
                              "--join-token-file", str(tmp_path / "g.token"),
                              "--ca-file", str(stack.cluster_ca))
        try:
            wait_for(lambda: "following the registry" in gateway.log(), "the gateway's watch")
            reply = admin.delete(f"/v1/tokens/{created['token_id']}")
            assert reply.json()["identities"] == ["gateway/gw-revoked"]
            # Its watch streams are cut, and it cannot follow again.
            wait_for(lambda: "lost the registry watch" in gateway.log(), "the watch cut", 5.0)
        finally:
            gateway.stop()
    revoked = as_identity(stack, tmp_path / "identity-gateway-gw-revoked")
    reply = httpx.get(stack.control_plane_url + "/v1/workers", verify=revoked, timeout=5)
    assert reply.status_code == 401
    # Workers learn it from their next heartbeat: its certificate, still valid
    # for an hour, no longer opens them either.
    url = stack.worker("sim-a")["registration"]["url"]  # type: ignore[index]
    revoked.check_hostname = False

    def refused_by_worker() -> bool:
        answer = httpx.get(url + "/status", verify=revoked, timeout=5)
        return answer.status_code == 401 and answer.json()["error"]["code"] == "identity_revoked"

    wait_for(refused_by_worker, "the worker to refuse the revoked gateway", 3.0)
    live = as_identity(stack, stack.root / "state" / next(
        p.name for p in (stack.root / "state").iterdir() if p.name.startswith("identity-gateway")),
        check_hostname=False)
    assert httpx.get(url + "/status", verify=live, timeout=5).status_code == 200


def test_certificates_renew_under_live_streams_and_no_stream_drops(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    try:
        # Certificates that live 6 s: the worker and the gateway renew every 4 s.
        stack.start_control_plane(lease_s=2.0, cert_ttl_s=6)
        worker = stack.start_worker("sim-r", *SIM, "--sim-output-tokens", "60",
                                    "--sim-decode-ms-per-token", "200")
        gateway = stack.start_gateway()
        worker_cert = stack.root / "state" / "identity-worker-sim-r" / "cert.pem"
        first = x509.load_pem_x509_certificate(worker_cert.read_bytes()).serial_number
        # One stream of 60 tokens, 12 s: the worker's and the gateway's certificates
        # are replaced under it at least twice, on the connections it does not use.
        with client(stack, timeout=60) as http, http.stream(
                "POST", "/v1/chat/completions", json=chat_body(60),
                headers={"cache-control": "no-cache"}) as response:
            assert response.status_code == 200
            text = "".join(response.iter_text())
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
        assert text.count("tok") >= 60
        assert x509.load_pem_x509_certificate(worker_cert.read_bytes()).serial_number != first
        assert worker.log().count("renewed worker/sim-r") >= 2
        assert gateway.log().count("renewed gateway/") >= 2
        # New connections after the renewals use the new certificates.
        with client(stack) as http:
            reply = http.post("/v1/chat/completions", json={**chat_body(3), "stream": False},
                              headers={"cache-control": "no-cache"})
            assert reply.status_code == 200
        assert stack.worker("sim-r") is not None
        not_after = x509.load_pem_x509_certificate(worker_cert.read_bytes()).not_valid_after_utc
        assert not_after - datetime.datetime.now(datetime.UTC) < datetime.timedelta(seconds=7)
    finally:
        stack.stop_all()


def test_an_operators_own_ca_and_certificates_work_without_joining(tmp_path: Path) -> None:
    """Bring your own PKI: the control plane issues from the operator's CA, and a
    worker runs on a certificate the operator's PKI made for it (no token)."""
    now = datetime.datetime.now(datetime.UTC)
    pki = ClusterCA.load_or_create(tmp_path / "pki", now)  # stands in for the operator's CA
    key = ec.generate_private_key(ec.SECP256R1())
    cert = pki.issue(key.public_key(), Identity("worker", "byo-1"),
                     lifetime=datetime.timedelta(hours=2), now=now)
    Credentials(tmp_path / "byo").write_issued(key, cert, pki.cert)
    stack = Stack(tmp_path / "stack")
    stack.root.mkdir()
    try:
        stack.join_port, stack.control_plane_port = free_port(), free_port()
        port = stack.control_plane_port
        proc = stack.spawn("control-plane", "control-plane", "--port", str(port),
                           "--ca-cert", str(tmp_path / "pki" / "ca.pem"),
                           "--ca-key", str(tmp_path / "pki" / "ca-key.pem"),
                           *stack.control_plane_args(stack.join_port))
        stack.wait_control_plane(proc, stack.control_plane_url)
        # The admin credential and serving certificate were reissued from the operator's CA.
        served = x509.load_pem_x509_certificate(
            (stack.control_plane_state / "identity" / "cert.pem").read_bytes())
        assert served.issuer == pki.cert.subject
        byo = tmp_path / "byo"
        worker = stack.spawn("byo-1", "worker", "--control-plane", stack.control_plane_url,
                             "--worker-id", "byo-1", *SIM, "--tls-cert", str(byo / "cert.pem"),
                             "--tls-key", str(byo / "key.pem"), "--ca-file", str(byo / "ca.pem"))
        wait_for(lambda: stack.worker("byo-1") is not None, "the BYO worker to register")
        stack.start_gateway()
        with client(stack) as http:
            reply = http.post("/v1/chat/completions", json={**chat_body(3), "stream": False})
            assert reply.status_code == 200 and reply.headers["x-hedgerow-worker"] == "byo-1"
        # A certificate whose identity is not the worker id it claims is refused at start.
        wrong = stack.spawn("byo-2", "worker", "--control-plane", stack.control_plane_url,
                            "--worker-id", "byo-2", *SIM, "--tls-cert", str(byo / "cert.pem"),
                            "--tls-key", str(byo / "key.pem"), "--ca-file", str(byo / "ca.pem"))
        assert wrong.popen.wait(30) == 1
        assert "is for worker/byo-1, not worker/byo-2" in wrong.log()
        assert worker.popen.poll() is None
    finally:
        stack.stop_all()
