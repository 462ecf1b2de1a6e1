"""Two control-plane replicas on one Redis share one trust book: a token made
through one joins through the other, and a revocation made through either is
enforced by both (real processes; a merge of books in-process)."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hedgerow.trust.identity import Identity
from hedgerow.trust.tokens import TrustBook
from tests.support.redis_server import RedisServer, redis_server
from tests.support.stack import Stack, free_port, wait_for

__all__ = ["redis_server"]

pytestmark = pytest.mark.e2e

SIM = ("--backend", "sim", "--no-warm-up")


@pytest.fixture
def replicas(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[Stack, str, str]]:
    redis_server.restart()
    stack = Stack(tmp_path)
    try:
        stack.start_control_plane(redis_url=redis_server.url)
        join_b = free_port()
        _, url_b = stack.start_control_plane_replica("control-plane-b", redis_url=redis_server.url,
                                                     join_port=join_b)
        yield stack, url_b, f"https://127.0.0.1:{join_b}"
    finally:
        stack.stop_all()


def test_a_token_made_through_one_replica_joins_through_the_other_and_revocation_is_shared(
        replicas: tuple[Stack, str, str], tmp_path: Path) -> None:
    stack, url_b, join_b = replicas
    with stack.admin() as admin_a:
        token = admin_a.post("/v1/tokens", json={"role": "worker", "ttl_s": 600}).json()["token"]
    (tmp_path / "w.token").write_text(token)
    worker = stack.spawn("sim-shared", "worker", "--control-plane", url_b,
                         "--worker-id", "sim-shared", "--state-dir", str(tmp_path / "w"), *SIM,
                         "--join-url", join_b, "--join-token-file", str(tmp_path / "w.token"),
                         "--ca-file", str(stack.cluster_ca))
    wait_for(lambda: stack.worker("sim-shared") is not None, "the worker to join through B")
    assert "joined as worker/sim-shared" in worker.log()
    cert = (tmp_path / "w" / "identity-worker-sim-shared")
    with stack.admin(url_b) as admin_b:
        assert admin_b.post("/v1/identities/revoke",
                            json={"identity": "worker/sim-shared"}).status_code == 200
    revoked_at = time.monotonic()
    context = ssl.create_default_context(cafile=stack.cluster_ca)
    context.load_cert_chain(cert / "cert.pem", cert / "key.pem")

    def refused_by_a() -> bool:
        reply = httpx.post(stack.control_plane_url + "/v1/workers/sim-shared/heartbeat",
                           json={"load": {}}, verify=context, timeout=5)
        return reply.status_code == 401 and reply.json()["error"]["code"] == "identity_revoked"

    wait_for(refused_by_a, "replica A to refuse the identity revoked through B", 5.0)
    assert time.monotonic() - revoked_at < 5.0
    with stack.admin() as admin_a:
        listed = admin_a.get("/v1/tokens").json()
    assert "worker/sim-shared" in listed["revoked"] and "worker/sim-shared" in listed["holders"]


def test_merging_books_never_undoes_a_revocation() -> None:
    ours, theirs = TrustBook(), TrustBook()
    text, record = ours.create_token("worker", 1000.0)
    ours.redeem(text, "w", 1001.0, cert_expires_at=5000.0)
    theirs.merge(ours)
    theirs.revoke_identity(Identity("worker", "w"), 2000.0)
    theirs.revoke_token(record.token_id, 2001.0)
    ours.revoke_identity(Identity("worker", "w"), 1500.0)  # an older revocation here
    ours.merge(theirs)
    assert ours.revoked["worker/w"] == 2001.0
    assert ours.tokens[record.token_id].revoked_at == 2001.0
    theirs.merge(ours)
    assert theirs.revoked["worker/w"] == 2001.0
    assert ours.is_revoked(Identity("worker", "w"), 1999.0)


def test_a_token_forged_into_redis_buys_nothing(replicas: tuple[Stack, str, str],
                                                redis_server: RedisServer) -> None:
    """Anyone who can write to Redis (a gateway's user, say) cannot mint a token:
    entries are sealed with a key derived from the CA's private key."""
    import hashlib

    import orjson
    from redis import Redis

    stack, _, join_b = replicas
    secret = "A" * 43
    forged = {"token_id": "aaaaaaaaaaaa", "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(),
              "role": "admin", "created_at": 0.0, "expires_at": 4e9, "name": None,
              "description": "", "revoked_at": None}
    client = Redis.from_url(redis_server.url)
    try:
        client.hset("hedgerow:trust:tokens", "aaaaaaaaaaaa", orjson.dumps({"r": forged, "m": "0" * 64}))
        client.hset("hedgerow:trust:revoked", "worker/x", "nan")
    finally:
        client.close()
    time.sleep(1.5)  # a sync or two
    from cryptography.hazmat.primitives.asymmetric import ec

    from hedgerow.trust.ca import make_csr

    csr = make_csr(ec.generate_private_key(ec.SECP256R1()), Identity("admin", "pwned")).decode()
    context = ssl.create_default_context(cafile=stack.cluster_ca)
    for join in (stack.join_url, join_b):
        reply = httpx.post(join + "/v1/join", json={"token": f"hjt.aaaaaaaaaaaa.{secret}",
                                                    "name": "pwned", "csr": csr},
                           verify=context, timeout=5)
        assert reply.status_code == 401, reply.text
    # The replicas still answer (a bad entry is skipped, not fatal) and log it once.
    with stack.admin() as admin:
        assert admin.get("/v1/tokens").status_code == 200
    assert "ignoring hedgerow:trust:tokens entry 'aaaaaaaaaaaa'" in stack.procs[0].log()
