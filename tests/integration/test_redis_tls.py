"""Redis as operators deploy it (TLS only, ACL user, default user off), from the client side.

A real ``redis-server`` (``tests.support.redis_tls``) started with the ACL
rules docs/deployment.md gives. What must hold: a plaintext client, a wrong
password, an untrusted CA, a certificate for another host and a missing
client certificate are all refused quickly with a message that names what to
fix and never the password; and every Redis operation Hedgerow performs
(registry, policy store, shared limits, exact and semantic cache with its
purges) works within that ACL, while anything else is denied.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import trustme
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError

from control_plane.policy_store import PolicyStore
from control_plane.redis_policy import RedisPolicyStore
from control_plane.redis_registry import RedisRegistry
from gateway.cache import ResponseCache
from gateway.cache.entry import CacheEntry
from gateway.corridor.shared_limits import SharedRequestLimits
from gateway.corridor.tickets import Ticket
from hedgerow.redis_conn import RedisSetupError, RedisTls, check_redis, open_redis
from hedgerow.wire import WorkerLoad, WorkerRegistration
from policies.loader import parse_policy_document
from policies.scoring import RouteRequest
from tests.support.cache_fakes import WordsEmbedder
from tests.support.redis_tls import TlsRedisServer, mtls_redis_server, tls_redis_server

__all__ = ["mtls_redis_server", "tls_redis_server"]

pytestmark = pytest.mark.anyio

FAST_S = 3.0  # a refusal comes at once: never a hang until some long timeout

POLICY = parse_policy_document("""
anonymous_tenant: a
classes: [{name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}]
tenants:
  - {name: a, class: interactive, limits: {requests_per_s: 1, requests_burst: 1}}
  - {name: b, class: interactive}
models: [{name: m}]
cache:
  redis_timeout_ms: 1000
  semantic: {enabled: true, pair_threshold: 0.8}  # the bag-of-words twin judges: its scale
""")
ANSWER = CacheEntry("About 3.1 miles.", "stop", 12, 5, "m", 1)


def opened(url: str, tls: RedisTls) -> Redis:
    return open_redis(url, tls, socket_timeout=2.0, connect_timeout=2.0)


async def refusal(server: TlsRedisServer, url: str, tls: RedisTls) -> str:
    """The start-up check's message for ``url``; it must come fast and keep the password out."""
    redis = opened(url, tls)
    started = time.monotonic()
    try:
        with pytest.raises(RedisSetupError) as refused:
            await check_redis(redis, url, tls)
    finally:
        await redis.aclose()
    assert time.monotonic() - started < FAST_S
    message = str(refused.value)
    assert server.password not in message and "wrong-password-123" not in message
    return message


@pytest.fixture
async def hedgerow_redis(tls_redis_server: TlsRedisServer) -> AsyncIterator[Redis]:
    redis = opened(tls_redis_server.url, tls_redis_server.tls)
    # The ACL user may not FLUSHDB: clean Hedgerow's own keys, as an operator could.
    async for key in redis.scan_iter(match="hedgerow:*"):
        await redis.delete(key)
    try:
        yield redis
    finally:
        await redis.aclose()


def test_a_plaintext_client_gets_no_answer_from_the_tls_port(
        tls_redis_server: TlsRedisServer) -> None:
    with socket.create_connection(("127.0.0.1", tls_redis_server.port), timeout=FAST_S) as plain:
        plain.sendall(f"AUTH hedgerow {tls_redis_server.password}\r\nPING\r\n".encode())
        try:
            answer = plain.recv(64)
        except ConnectionResetError:
            answer = b""
    assert b"+OK" not in answer and b"PONG" not in answer


async def test_a_plaintext_url_is_refused_quickly(tls_redis_server: TlsRedisServer) -> None:
    url = f"redis://hedgerow:{tls_redis_server.password}@127.0.0.1:{tls_redis_server.port}/0"
    redis = opened(url, RedisTls())
    started = time.monotonic()
    with pytest.raises(RedisConnectionError):
        await redis.ping()  # type: ignore[misc]
    await redis.aclose()
    assert time.monotonic() - started < FAST_S + 10  # redis-py's own retries, then the error
    # The start-up check tries once and says what is likely wrong.
    redis = opened(url, RedisTls())
    assert await check_redis(redis, url) is False
    await redis.aclose()


async def test_a_wrong_password_is_refused(tls_redis_server: TlsRedisServer) -> None:
    message = await refusal(tls_redis_server,
                            tls_redis_server.url_for(password="wrong-password-123"),
                            tls_redis_server.tls)
    assert "authentication refused" in message and "hedgerow:***@" in message


async def test_the_default_user_is_off(tls_redis_server: TlsRedisServer) -> None:
    url = f"rediss://127.0.0.1:{tls_redis_server.port}/0"
    assert "authentication refused" in await refusal(tls_redis_server, url, tls_redis_server.tls)


async def test_a_server_certificate_from_another_ca_is_refused(
        tls_redis_server: TlsRedisServer, tmp_path: Path) -> None:
    stranger = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(stranger))
    message = await refusal(tls_redis_server, tls_redis_server.url, RedisTls(stranger))
    assert "certificate is not trusted" in message and str(stranger) in message


async def test_a_certificate_for_another_host_is_refused(
        tls_redis_server: TlsRedisServer) -> None:
    # The server's certificate names 127.0.0.1 only: the hostname is checked.
    message = await refusal(tls_redis_server, tls_redis_server.url_for(host="localhost"),
                            tls_redis_server.tls)
    assert "certificate is not valid for 'localhost'" in message


async def test_a_client_certificate_is_required_when_the_server_asks(
        mtls_redis_server: TlsRedisServer) -> None:
    server = mtls_redis_server
    message = await refusal(server, server.url, RedisTls(server.ca_file))
    assert "--redis-cert-file" in message
    redis = opened(server.url, server.tls)
    try:
        assert await check_redis(redis, server.url, server.tls) is True
        assert await redis.set("hedgerow:probe", "1")
    finally:
        await redis.aclose()


async def test_the_acl_denies_other_keys_and_dangerous_commands(hedgerow_redis: Redis) -> None:
    assert await hedgerow_redis.set("hedgerow:mine", "1")
    for command in [("SET", "elsewhere", "1"), ("GET", "session:42"), ("FLUSHALL",),
                    ("FLUSHDB",), ("KEYS", "*"), ("CONFIG", "GET", "requirepass"),
                    ("ACL", "LIST"), ("EVAL", "return 1", "0"), ("SCRIPT", "FLUSH"),
                    ("SHUTDOWN",), ("PUBLISH", "hedgerow:x", "1"),
                    ("CLIENT", "LIST"), ("MONITOR",)]:
        with pytest.raises(NoPermissionError):
            await hedgerow_redis.execute_command(*command)  # type: ignore[no-untyped-call]


async def test_the_registry_and_policy_store_work_within_the_acl(hedgerow_redis: Redis) -> None:
    registry = RedisRegistry(hedgerow_redis, lease_s=0.3)
    await registry.register(WorkerRegistration(worker_id="w1", url="http://127.0.0.1:1/w1",
                                               kind="cpu", models=("m",), slots=2))
    await registry.heartbeat("w1", WorkerLoad(active=1))
    snapshot = await registry.snapshot()
    assert [w.registration.worker_id for w in snapshot.workers] == ["w1"]
    assert snapshot.workers[0].load.active == 1
    await anyio.sleep(0.4)
    assert await registry.expire() == ("w1",)
    assert await registry.ensure_version_at_least(100)
    assert await registry.version() > 100

    store = RedisPolicyStore(hedgerow_redis)
    text = "limits: {max_tokens: 100}\n"
    await store.seed(PolicyStore(parse_policy_document(text), text, source="boot",
                                 now=1.0).current)
    applied, changed = await store.apply("limits: {max_tokens: 200}\n", "test", now=2.0)
    assert changed and (await store.current()).version == applied.version
    assert [v.version for v in await store.history()] == [1, applied.version]


def _ticket(tenant: str) -> Ticket:
    return Ticket(request_id="r", tenant=tenant, model="m", arrival=0.0, deadline=10.0,
                  estimated_tokens=10, route=RouteRequest(prompt_tokens=5), hedgeable=False,
                  policy=POLICY)


async def test_shared_limits_work_within_the_acl(hedgerow_redis: Redis) -> None:
    limits = SharedRequestLimits(hedgerow_redis)
    first, second = _ticket("a"), _ticket("a")
    assert await limits.check(first) is None
    refused = await limits.check(second)  # a burst of one, shared through Redis
    assert refused is not None and refused.reason == "requests_rate"
    await limits.settle(first, 3)
    assert limits.counters["fallback"] == 0


async def test_the_cache_works_within_the_acl(tls_redis_server: TlsRedisServer,
                                              hedgerow_redis: Redis) -> None:
    def question(text: str) -> dict[str, object]:
        return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}

    one = ResponseCache(POLICY, tls_redis_server.url, embedder=WordsEmbedder(),
                        redis_tls=tls_redis_server.tls, origin="one")
    two = ResponseCache(POLICY, tls_redis_server.url, embedder=WordsEmbedder(),
                        redis_tls=tls_redis_server.tls, origin="two")
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(one.run)
            await tg.start(two.run)
            assert await one.store("a", None, question("how far is 5 km in miles"), ANSWER)
            exact = await two.lookup("a", None, question("how far is 5 km in miles"), {})
            assert exact is not None and exact.kind == "exact"
            with anyio.fail_after(5):  # the semantic entry reaches two through the stream
                while (await two.lookup("a", None, question("how far is 5 km in miles please"),
                                        {})) is None:
                    await anyio.sleep(0.05)
            assert await one.purge(tenant="a") >= 1
            assert await one.store("b", None, question("what is 2 plus 2"), ANSWER)
            assert await one.purge() >= 1  # everything: a SCAN over hedgerow:cache:exact:*
            for cache in (one, two):
                stats = cache.stats()
                assert (stats["redis_errors"], stats["redis_timeouts"],
                        stats["redis_sync_faults"]) == (0, 0, 0)
            tg.cancel_scope.cancel()
    finally:
        await one.aclose()
        await two.aclose()
    assert [key async for key in hedgerow_redis.scan_iter(match="hedgerow:cache:exact:*")] == []


def test_the_fixture_really_is_tls_only(tls_redis_server: TlsRedisServer) -> None:
    """Guards the tests above: the server has no plaintext port and verifies nothing less."""
    config = tls_redis_server.config()
    assert "port 0\n" in config and "user default off\n" in config
    context = ssl.create_default_context()  # the system's CAs: they do not know this one
    with socket.create_connection(("127.0.0.1", tls_redis_server.port), timeout=FAST_S) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            context.wrap_socket(raw, server_hostname="127.0.0.1")
