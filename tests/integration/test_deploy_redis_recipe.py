"""The Kubernetes recipe's Redis, run for real: its own redis.conf, ACL template
and start command (deploy/kubernetes/redis.yaml) on a loopback port, with a
throwaway CA. Plaintext and anonymous clients are refused; Hedgerow's own
Redis code (registry scripts, the shared cache) works as the ``hedgerow``
user, and that user can touch nothing outside ``hedgerow:``.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError, ResponseError

from control_plane.redis_registry import RedisRegistry
from gateway.cache.entry import CacheEntry
from gateway.cache.store import ExactKey, RedisStore
from hedgerow.wire import WorkerLoad, WorkerRegistration
from tests.support.deploy_recipes import named, pod_spec, workloads
from tests.support.stack import free_port

pytestmark = pytest.mark.anyio

START_TIMEOUT_S = 10.0


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def write_tls(directory: Path) -> None:
    """ca.crt, and tls.crt/tls.key for redis, localhost and 127.0.0.1, as the Secret holds them."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("test redis CA")).issuer_name(_name("test redis CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=1))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("redis"), x509.DNSName("localhost"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(_name("redis")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True)
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))



@dataclass
class RecipeRedis:
    root: Path
    port: int
    password: str
    popen: subprocess.Popen[bytes]

    @property
    def ca(self) -> str:
        return str(self.root / "etc/redis/tls/ca.crt")

    def client(self, username: str | None = None, password: str | None = None) -> Redis:
        # No retries: a refusal must show at once, not after redis-py's backoff.
        return Redis(host="127.0.0.1", port=self.port, ssl=True, ssl_ca_certs=self.ca,
                     ssl_cert_reqs="required", socket_timeout=5, retry=Retry(NoBackoff(), 0),
                     username=username, password=password)

    def hedgerow(self) -> Redis:
        return self.client(username="hedgerow", password=self.password)


def under(root: Path, text: str) -> str:
    """The recipe's absolute paths, moved under ``root``."""
    return re.sub(r"(?<![\w/])(/etc/redis|/run/redis|/data)\b", lambda m: f"{root}{m[1]}", text)


def start(root: Path) -> RecipeRedis:
    config = named("ConfigMap", "redis-config")["data"]
    (redis,) = [d for d in workloads() if d["metadata"]["name"] == "redis"]
    (container,) = pod_spec(redis)["containers"]
    port, password = free_port(), secrets.token_hex(32)
    conf = root / "etc/redis/conf"
    conf.mkdir(parents=True)
    # Loopback only here; the pod's own address is all it has in the cluster.
    (conf / "redis.conf").write_text(
        under(root, config["redis.conf"]).replace("tls-port 6380", f"tls-port {port}")
        + "bind 127.0.0.1\n")
    (conf / "users.acl.in").write_text(config["users.acl.in"])
    (root / "etc/redis/auth").mkdir(parents=True)
    (root / "etc/redis/auth/password").write_text(password)  # as the Secret holds it: no newline
    write_tls(root / "etc/redis/tls")
    (root / "run/redis").mkdir(parents=True)
    (root / "data").mkdir()
    assert shutil.which("redis-server"), "redis-server is not installed (apt-get install redis-server)"
    log = (root / "redis.log").open("ab")
    popen = subprocess.Popen(under(root, " ".join(container["command"][:2])).split()
                             + [under(root, container["command"][2])],
                             stdout=log, stderr=subprocess.STDOUT)
    wait_for_tls(port, root, popen)
    return RecipeRedis(root, port, password, popen)


def wait_for_tls(port: int, root: Path, popen: subprocess.Popen[bytes]) -> None:
    context = ssl.create_default_context(cafile=str(root / "etc/redis/tls/ca.crt"))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and popen.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1"):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the recipe's Redis did not start: {(root / 'redis.log').read_text()}")


@pytest.fixture(scope="module")
def recipe_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecipeRedis]:
    server = start(tmp_path_factory.mktemp("recipe-redis"))
    try:
        yield server
    finally:
        server.popen.terminate()
        server.popen.wait(10)


@pytest.fixture
async def hedgerow(recipe_redis: RecipeRedis) -> AsyncIterator[Redis]:
    client = recipe_redis.hedgerow()
    try:
        yield client
    finally:
        await client.aclose()


async def test_a_plaintext_client_is_refused(recipe_redis: RecipeRedis) -> None:
    plain = Redis(host="127.0.0.1", port=recipe_redis.port, socket_timeout=2,
                  retry=Retry(NoBackoff(), 0), username="hedgerow", password=recipe_redis.password)
    with pytest.raises((ConnectionError, TimeoutError)):
        await plain.ping()
    await plain.aclose()


async def test_the_default_user_is_off(recipe_redis: RecipeRedis) -> None:
    anonymous = recipe_redis.client()
    with pytest.raises((AuthenticationError, ResponseError)):
        await anonymous.ping()
    await anonymous.aclose()
    default = recipe_redis.client(username="default", password="")
    with pytest.raises(AuthenticationError):
        await default.ping()
    await default.aclose()


async def test_a_wrong_password_is_refused(recipe_redis: RecipeRedis) -> None:
    wrong = recipe_redis.client(username="hedgerow", password=secrets.token_hex(32))
    with pytest.raises(AuthenticationError):
        await wrong.ping()
    await wrong.aclose()


async def test_hedgerows_registry_and_cache_work_as_the_hedgerow_user(hedgerow: Redis) -> None:
    registry = RedisRegistry(hedgerow, lease_s=5)
    await registry.register(WorkerRegistration(worker_id="w1", url="https://127.0.0.1:1",
                                               kind="cpu", models=("m",), slots=2))
    await registry.heartbeat("w1", WorkerLoad(active=1))
    snapshot = await registry.snapshot()
    assert [w.registration.worker_id for w in snapshot.workers] == ["w1"]
    assert await registry.expire() == ()
    await registry.deregister("w1")
    store = RedisStore(hedgerow, ttl_s=60)
    key = ExactKey("k1", "tenant:a", "m")
    await store.put(key, CacheEntry("hi", "stop", 3, 1, "m", 1), 0)
    cached = await store.get(key, 0)
    assert cached is not None and cached.text == "hi"
    assert await store.purge() == 1


async def test_the_hedgerow_user_reaches_nothing_outside_its_keys(hedgerow: Redis) -> None:
    with pytest.raises(NoPermissionError):
        await hedgerow.set("other:key", "x")
    with pytest.raises(NoPermissionError):
        await hedgerow.get("session:1")
    for refused in (hedgerow.flushall(), hedgerow.config_get("*"), hedgerow.keys("*"),
                    hedgerow.execute_command("ACL", "LIST"), hedgerow.execute_command("CLIENT", "KILL", "ID", "999999")):
        with pytest.raises(NoPermissionError):
            await refused


async def test_the_acl_file_holds_the_passwords_hash_not_the_password(recipe_redis: RecipeRedis) -> None:
    acl = (recipe_redis.root / "run/redis/users.acl").read_text()
    assert recipe_redis.password not in acl
    assert hashlib.sha256(recipe_redis.password.encode()).hexdigest() in acl
