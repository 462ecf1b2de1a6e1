"""The gateway transport over real sockets and real TLS.

One port serves HTTP/1.1 and HTTP/2 (TLS over TCP, ALPN) and HTTP/3 (QUIC
over UDP). Streams reach clients chunk by chunk; returning clients resume
their TLS / QUIC sessions; accepted TCP sockets have Nagle off; the
development certificate is made once, reused, and trusted through its CA.
"""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import stat
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.transport import build_config, serve
from tests.support.h3client import h3_request

CHUNKS = 5
CHUNK_GAP_S = 0.05
# Five chunks 50 ms apart span at least 200 ms; a buffered response spans ~0.
MIN_STREAM_SPREAD_S = 0.15
EXPECTED_BODY = b"".join(b"chunk %d\n" % index for index in range(CHUNKS))


@pytest.fixture(scope="module")
def dev_cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("state"))


async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await _run_lifespan(receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-app", b"test")]})
    for index in range(CHUNKS):
        chunk = b"chunk %d\n" % index
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await anyio.sleep(CHUNK_GAP_S)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _run_lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@asynccontextmanager
async def running_gateway(
    cert: DevCertificate, hosts: Sequence[str] = ("127.0.0.1",)
) -> AsyncIterator[int]:
    config = build_config(host=list(hosts), port=0, certfile=cert.cert, keyfile=cert.key)
    stop = anyio.Event()
    async with anyio.create_task_group() as task_group:
        port = await task_group.start(serve, streaming_app, config, stop.wait)
        try:
            yield port
        finally:
            stop.set()


def client_context(cert: DevCertificate, alpn: Sequence[str] = ("http/1.1",)) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cert.ca_cert))
    context.set_alpn_protocols(list(alpn))
    return context


async def _stream_with_httpx(url: str, cert: DevCertificate, *, http2: bool) -> tuple[
    httpx.Response, list[tuple[bytes, float]]
]:
    context = client_context(cert, ["h2", "http/1.1"] if http2 else ["http/1.1"])
    async with httpx.AsyncClient(http1=not http2, http2=http2, verify=context) as client:
        async with client.stream("GET", url) as response:
            arrivals = [(chunk, time.monotonic()) async for chunk in response.aiter_raw()]
    return response, arrivals


def _spread_s(arrival_times: Sequence[float]) -> float:
    return arrival_times[-1] - arrival_times[0]


# --- HTTP/1.1, HTTP/2, HTTP/3 on one port ----------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("http2, version", [(False, "HTTP/1.1"), (True, "HTTP/2")])
async def test_tcp_stream_arrives_chunk_by_chunk_with_alt_svc(
    dev_cert: DevCertificate, http2: bool, version: str
) -> None:
    async with running_gateway(dev_cert) as port:
        url = f"https://localhost:{port}/stream"
        response, arrivals = await _stream_with_httpx(url, dev_cert, http2=http2)

    assert response.status_code == 200
    assert response.http_version == version
    assert b"".join(chunk for chunk, _ in arrivals) == EXPECTED_BODY
    assert _spread_s([at for _, at in arrivals]) >= MIN_STREAM_SPREAD_S
    assert response.headers.get_list("alt-svc") == [f'h3=":{port}"; ma=3600']


@pytest.mark.anyio
async def test_http3_on_the_same_port_streams_chunk_by_chunk(dev_cert: DevCertificate) -> None:
    async with running_gateway(dev_cert) as port:
        response = await h3_request("127.0.0.1", port, "GET", "/stream", cafile=dev_cert.ca_cert)

    assert response.alpn_protocol == "h3"
    assert response.status == 200
    assert response.header("x-app") == "test"
    assert response.body == EXPECTED_BODY
    assert len(response.chunks) == CHUNKS
    assert _spread_s([chunk.received_at for chunk in response.chunks]) >= MIN_STREAM_SPREAD_S


@pytest.mark.anyio
async def test_ipv6_loopback_serves_h2_and_h3(dev_cert: DevCertificate) -> None:
    async with running_gateway(dev_cert, hosts=("127.0.0.1", "::1")) as port:
        h2_response, _ = await _stream_with_httpx(f"https://[::1]:{port}/", dev_cert, http2=True)
        h3_response = await h3_request("::1", port, cafile=dev_cert.ca_cert)

    assert (h2_response.status_code, h2_response.http_version) == (200, "HTTP/2")
    assert (h3_response.status, h3_response.body) == (200, EXPECTED_BODY)


# --- resumption -------------------------------------------------------------


def _fetch_over_tls(
    port: int, context: ssl.SSLContext, session: ssl.SSLSession | None
) -> tuple[bytes, ssl.SSLSession, bool, str | None]:
    """Blocking: with TLS 1.3 the ticket arrives after the handshake, so the
    session is taken only after the whole response has been read."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost", session=session) as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
            response = b""
            while data := tls.recv(65536):
                response += data
            assert tls.session is not None
            return response, tls.session, tls.session_reused, tls.version()


@pytest.mark.anyio
async def test_returning_tls_client_resumes_its_session(dev_cert: DevCertificate) -> None:
    context = client_context(dev_cert)
    async with running_gateway(dev_cert) as port:
        first, session, first_reused, first_version = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, context, None
        )
        second, _, second_reused, _ = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, context, session
        )

    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")
    assert first_version == "TLSv1.3"
    assert (first_reused, second_reused) == (False, True)


@pytest.mark.anyio
async def test_returning_quic_client_resumes_once_per_ticket(dev_cert: DevCertificate) -> None:
    async with running_gateway(dev_cert) as port:
        first = await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert)
        ticket = first.session_ticket
        resumed = await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert, session_ticket=ticket)
        replayed = await h3_request(
            "127.0.0.1", port, cafile=dev_cert.ca_cert, session_ticket=ticket, ticket_wait_s=0
        )

    assert ticket is not None
    assert (first.status, resumed.status, replayed.status) == (200, 200, 200)
    assert (first.session_resumed, resumed.session_resumed) == (False, True)
    # Tickets are single use (RFC 8446 section 8.1 anti-replay): a second
    # presentation falls back to a full handshake and still gets served.
    assert replayed.session_resumed is False


# --- TCP_NODELAY ------------------------------------------------------------


def _server_side_nodelay(client_address: tuple[Any, ...]) -> int:
    """TCP_NODELAY of this process's socket whose peer is ``client_address``."""
    for name in os.listdir("/proc/self/fd"):
        try:
            duplicate = os.dup(int(name))
        except OSError:
            continue  # the listing's own descriptor, already closed
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            continue  # not a socket
        with sock:
            if sock.type != socket.SOCK_STREAM or _peer(sock) != client_address[:2]:
                continue
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    raise AssertionError(f"no accepted socket has peer {client_address}")


def _peer(sock: socket.socket) -> tuple[Any, ...] | None:
    try:
        return tuple(sock.getpeername()[:2])
    except OSError:
        return None  # listening or unconnected


@pytest.mark.anyio
async def test_accepted_tcp_socket_has_nagle_disabled(dev_cert: DevCertificate) -> None:
    async with running_gateway(dev_cert) as port:
        async with await anyio.connect_tcp(
            "127.0.0.1", port, ssl_context=client_context(dev_cert), tls_hostname="localhost"
        ) as stream:
            await stream.send(b"GET / HTTP/1.1\r\nhost: localhost\r\n\r\n")
            received = b""
            while not received.endswith(b"0\r\n\r\n"):
                received += await stream.receive()
            client_address = stream.extra(SocketAttribute.local_address)
            nodelay = _server_side_nodelay(tuple(client_address))

    assert received.startswith(b"HTTP/1.1 200")
    assert nodelay != 0


# --- lifecycle --------------------------------------------------------------


def _port_is_free(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


@pytest.mark.anyio
async def test_shutdown_is_prompt_and_releases_both_sockets(dev_cert: DevCertificate) -> None:
    async with running_gateway(dev_cert) as port:
        await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert)
        assert not _port_is_free(port)
        stopping_at = time.monotonic()

    assert time.monotonic() - stopping_at < 1.0  # graceful_timeout is 5 s
    assert _port_is_free(port)


@pytest.mark.anyio
async def test_cancelling_serve_drains_and_releases_the_port(dev_cert: DevCertificate) -> None:
    config = build_config(port=0, certfile=dev_cert.cert, keyfile=dev_cert.key)
    never = anyio.Event()
    async with anyio.create_task_group() as task_group:
        port = await task_group.start(serve, streaming_app, config, never.wait)
        response = await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert)
        task_group.cancel_scope.cancel()

    assert response.status == 200
    assert _port_is_free(port)


# --- development certificate ------------------------------------------------


def test_dev_certificate_is_reused_and_keys_are_private(tmp_path: Path) -> None:
    first = ensure_dev_certificate(tmp_path)
    contents = [path.read_bytes() for path in (first.ca_cert, first.cert, first.key)]
    second = ensure_dev_certificate(tmp_path)

    assert second == first
    assert [path.read_bytes() for path in (second.ca_cert, second.cert, second.key)] == contents
    assert first.cert.parent == tmp_path / "tls"
    for key in (first.key, tmp_path / "tls" / "ca-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_expiring_leaf_is_reissued_by_the_same_ca(tmp_path: Path) -> None:
    first = ensure_dev_certificate(tmp_path)
    ca, leaf = first.ca_cert.read_bytes(), first.cert.read_bytes()
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=340)
    renewed = ensure_dev_certificate(tmp_path, now=later)

    assert renewed.ca_cert.read_bytes() == ca
    assert renewed.cert.read_bytes() != leaf


@pytest.mark.anyio
async def test_clients_trust_the_server_only_through_the_dev_ca(dev_cert: DevCertificate) -> None:
    untrusting = ssl.create_default_context()
    async with running_gateway(dev_cert) as port:
        trusted, *_ = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, client_context(dev_cert), None
        )
        with pytest.raises(ssl.SSLCertVerificationError):
            await anyio.to_thread.run_sync(_fetch_over_tls, port, untrusting, None)

    assert trusted.startswith(b"HTTP/1.1 200")
