"""The gateway's TLS: 1.2 or 1.3 only, AEAD ciphers with forward secrecy only.

Checked on the live listener: a client that offers at most TLS 1.1, or TLS 1.2
with only CBC (non-AEAD) ciphers, gets no connection; the same client allowed
TLS 1.2 with an AEAD cipher connects (so the refusals are the server's).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.transport import build_config, serve

AEAD = ("GCM", "CHACHA20", "CCM")
# The point is to offer the deprecated versions.
pytestmark = pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")


@pytest.fixture(scope="module")
def dev_cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("state"))


async def _ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def _listening(cert: DevCertificate) -> AsyncIterator[int]:
    config = build_config(host="127.0.0.1", port=0, certfile=cert.cert, keyfile=cert.key,
                          http3=False)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, _ok_app, config, stop.wait)
        try:
            yield port
        finally:
            stop.set()


def _client(ca: Path, *, maximum: ssl.TLSVersion, ciphers: str) -> ssl.SSLContext:
    """A deliberately permissive client: whatever it is refused, the server refused."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(ca)
    context.set_ciphers(ciphers)
    context.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    context.maximum_version = maximum
    return context


def _handshake(port: int, context: ssl.SSLContext) -> str | None:
    """The negotiated cipher, or None when the server refused the handshake."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                cipher = tls.cipher()
                return None if cipher is None else f"{tls.version()} {cipher[0]}"
        except (ssl.SSLError, ConnectionError):
            return None


def test_the_context_allows_tls_1_2_and_up_with_aead_ciphers_only(
        dev_cert: DevCertificate) -> None:
    config = build_config(host="127.0.0.1", port=0, certfile=dev_cert.cert,
                          keyfile=dev_cert.key, http3=False)
    context = config.create_ssl_context()
    assert context is not None
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    ciphers = context.get_ciphers()
    assert ciphers
    for cipher in ciphers:
        assert any(mark in cipher["name"] for mark in AEAD), cipher["name"]
        assert cipher["protocol"] == "TLSv1.3" or cipher["kea"] == "kx-ecdhe", cipher
    assert context.options & ssl.OP_NO_COMPRESSION
    assert context.options & ssl.OP_NO_RENEGOTIATION


@pytest.mark.anyio
async def test_old_protocols_and_non_aead_ciphers_are_refused_on_the_wire(
        dev_cert: DevCertificate) -> None:
    async with _listening(dev_cert) as port:
        permissive = "ALL:@SECLEVEL=0"

        def attempt(maximum: ssl.TLSVersion, ciphers: str) -> str | None:
            return _handshake(port, _client(dev_cert.ca_cert, maximum=maximum, ciphers=ciphers))

        for maximum in (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1):
            assert await anyio.to_thread.run_sync(attempt, maximum, permissive) is None
        cbc_only = "ECDHE-ECDSA-AES128-SHA:ECDHE-ECDSA-AES256-SHA:ECDHE-ECDSA-AES128-SHA256"
        assert await anyio.to_thread.run_sync(attempt, ssl.TLSVersion.TLSv1_2, cbc_only) is None
        tls12 = await anyio.to_thread.run_sync(attempt, ssl.TLSVersion.TLSv1_2, permissive)
        assert tls12 is not None and tls12.startswith("TLSv1.2") and "GCM" in tls12
        tls13 = await anyio.to_thread.run_sync(attempt, ssl.TLSVersion.TLSv1_3, permissive)
        assert tls13 is not None and tls13.startswith("TLSv1.3")


def test_the_permissive_client_really_speaks_tls_1_1(dev_cert: DevCertificate) -> None:
    """Guard: the same client reaches a server that allows TLS 1.1, so the refusal
    above is the gateway's and not this OpenSSL's."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(dev_cert.cert, dev_cert.key)
    server.set_ciphers("ALL:@SECLEVEL=0")
    server.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def accept_one() -> None:
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError):
                pass

        thread = threading.Thread(target=accept_one, daemon=True)
        thread.start()
        old = _handshake(port, _client(dev_cert.ca_cert, maximum=ssl.TLSVersion.TLSv1_1,
                                       ciphers="ALL:@SECLEVEL=0"))
        thread.join(5)
    assert old is not None and old.startswith("TLSv1.1"), old
