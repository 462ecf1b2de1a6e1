"""A throwaway ``redis-server`` as operators run it: TLS only, an ACL user, no default user.

Like ``tests.support.redis_server``: a free loopback port, a temporary
directory, no persistence, never the machine's own Redis. The plaintext port
is off (``port 0``); the server speaks TLS on ``tls-port`` with a certificate
for 127.0.0.1 from a CA minted here (trustme); ``user default off`` and one
user ``hedgerow`` with ``hedgerow.redis_conn.ACL_RULES`` (the rules
docs/deployment.md gives operators) and a random password, stored hashed.
``client_certs=True``: ``tls-auth-clients yes``, and ``client_cert`` holds a
certificate from the same CA.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from hedgerow.redis_conn import ACL_RULES, RedisTls
from tests.support.redis_server import START_TIMEOUT_S, _free_port

USER = "hedgerow"


class TlsRedisServer:
    def __init__(self, directory: Path, *, client_certs: bool = False) -> None:
        self.directory = directory
        self.client_certs = client_certs
        self.port = _free_port()
        self.password = secrets.token_urlsafe(18)
        self.popen: subprocess.Popen[bytes] | None = None
        self.ca = trustme.CA()
        self.ca_file = directory / "redis-ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        server = self.ca.issue_cert("127.0.0.1")
        self.server_cert, self.server_key = directory / "server.pem", directory / "server.key"
        server.cert_chain_pems[0].write_to_path(str(self.server_cert))
        server.private_key_pem.write_to_path(str(self.server_key))
        client = self.ca.issue_cert("hedgerow-client")
        self.client_cert, self.client_key = directory / "client.pem", directory / "client.key"
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        client.private_key_pem.write_to_path(str(self.client_key))

    def url_for(self, user: str = USER, password: str | None = None,
                host: str = "127.0.0.1") -> str:
        return f"rediss://{user}:{self.password if password is None else password}@{host}:{self.port}/0"

    @property
    def url(self) -> str:
        return self.url_for()

    @property
    def tls(self) -> RedisTls:
        """What a Hedgerow process is given: the CA, and a client certificate if needed."""
        if self.client_certs:
            return RedisTls(self.ca_file, self.client_cert, self.client_key)
        return RedisTls(self.ca_file)

    def tls_args(self) -> list[str]:
        """The same as ``hedgerow`` command-line flags."""
        tls = self.tls
        args = ["--redis-ca-file", str(tls.ca_file)]
        if tls.cert_file is not None and tls.key_file is not None:
            args += ["--redis-cert-file", str(tls.cert_file), "--redis-key-file", str(tls.key_file)]
        return args

    def config(self) -> str:
        """redis.conf, as docs/deployment.md gives it (paths and port filled in)."""
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        return "\n".join([
            "port 0",
            f"tls-port {self.port}",
            "bind 127.0.0.1 -::1",
            f"tls-cert-file {self.server_cert}",
            f"tls-key-file {self.server_key}",
            f"tls-ca-cert-file {self.ca_file}",
            f"tls-auth-clients {'yes' if self.client_certs else 'no'}",
            "user default off",
            f"user {USER} on #{digest} {ACL_RULES}",
            'save ""',
            "appendonly no",
            f"dir {self.directory}",
        ]) + "\n"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        conf = self.directory / "redis.conf"
        conf.write_text(self.config())
        log = (self.directory / "redis.log").open("ab")
        self.popen = subprocess.Popen([binary, str(conf)], stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)
        self.popen = None

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if self.client_certs:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        hello = f"AUTH {USER} {self.password}\r\nPING\r\n".encode()
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")
                raise RuntimeError(f"redis-server exited:\n{log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as raw, \
                        self.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as conn:
                    conn.sendall(hello)
                    if _read_until(conn, b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server (TLS) on port {self.port} did not start")


def _read_until(conn: ssl.SSLSocket, marker: bytes) -> bool:
    seen = b""
    while marker not in seen:
        chunk = conn.recv(256)
        if not chunk:
            return False
        seen += chunk
    return True


def _start(directory: Path, client_certs: bool) -> TlsRedisServer:
    server = TlsRedisServer(directory, client_certs=client_certs)
    server.start()
    return server


@pytest.fixture(scope="module")
def tls_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedisServer]:
    server = _start(tmp_path_factory.mktemp("redis-tls"), client_certs=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mtls_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedisServer]:
    """The same with ``tls-auth-clients yes``: a client certificate is required."""
    server = _start(tmp_path_factory.mktemp("redis-mtls"), client_certs=True)
    try:
        yield server
    finally:
        server.stop()
