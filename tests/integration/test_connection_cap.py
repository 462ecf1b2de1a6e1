"""The open-connection cap over real sockets and real TLS, served in-process.

With a ``ConnectionCap`` given to ``serve``, a TCP connection accepted while
the cap is full is closed at once (EOF, long before the handshake timeout),
connections already open keep being served, and a slot comes back when a
connection closes — after a normal request, or when its handshake timed out.
Through the cap TLS still negotiates HTTP/2 and resumes sessions.
(The whole gateway under a flood: ``tests/faults/test_fault_connection_cap.py``.)
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import httpx
import pytest
from anyio.abc import SocketStream

from hedgerow.connection_cap import ConnectionCap
from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.transport import build_config, serve
from tests.integration.test_transport import _fetch_over_tls, client_context, streaming_app

# Well under the real 5 s handshake timeout: a connection closed sooner was refused.
PROMPT_S = 1.0


@pytest.fixture(params=[pytest.param(False, id="asyncio"), pytest.param(True, id="uvloop")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    # The gateway runs on uvloop, whose transports differ from asyncio's.
    return "asyncio", {"use_uvloop": request.param}


@pytest.fixture(scope="module")
def dev_cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("state"))


@asynccontextmanager
async def capped_gateway(cert: DevCertificate, cap: ConnectionCap,
                         handshake_timeout_s: float | None = None) -> AsyncIterator[int]:
    config = build_config(host="127.0.0.1", port=0, certfile=cert.cert, keyfile=cert.key)
    if handshake_timeout_s is not None:
        config.ssl_handshake_timeout = handshake_timeout_s
    stop = anyio.Event()
    async with anyio.create_task_group() as task_group:
        port = await task_group.start(functools.partial(serve, connection_cap=cap),
                                      streaming_app, config, stop.wait)
        try:
            yield port
        finally:
            stop.set()


def _client(cert: DevCertificate, port: int, *, http2: bool = False) -> httpx.AsyncClient:
    alpn: Sequence[str] = ("h2", "http/1.1") if http2 else ("http/1.1",)
    return httpx.AsyncClient(base_url=f"https://localhost:{port}", http2=http2,
                             verify=client_context(cert, alpn), timeout=5)


async def _closed_within(stream: SocketStream, seconds: float) -> bool:
    """Whether the server closed ``stream`` within ``seconds`` (it never sends first)."""
    with anyio.move_on_after(seconds):
        try:
            data = await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return True
        raise AssertionError(f"the server sent {data!r} before any ClientHello")
    return False


async def _wait_until(condition: Callable[[], bool], seconds: float = 3.0) -> None:
    with anyio.fail_after(seconds):
        while not condition():
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_beyond_the_cap_new_connections_are_closed_and_open_ones_served(
        dev_cert: DevCertificate) -> None:
    cap = ConnectionCap(3)
    async with capped_gateway(dev_cert, cap) as port, _client(dev_cert, port) as kept:
        assert (await kept.get("/")).status_code == 200  # one connection, kept alive
        raw = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(6)]
        closed = [await _closed_within(stream, PROMPT_S) for stream in raw]
        assert closed == [False, False, True, True, True, True]
        assert cap.stats() == {"open": 3, "refused": 4, "limit": 3}
        # The connection already open is still served; a new client is not.
        assert (await kept.get("/")).status_code == 200
        async with _client(dev_cert, port) as newcomer:
            with pytest.raises(httpx.TransportError):
                await newcomer.get("/")
        assert cap.refused == 5
        for stream in raw:
            await stream.aclose()
        await _wait_until(lambda: cap.open == 1)
        async with _client(dev_cert, port, http2=True) as later:
            response = await later.get("/")
        assert (response.status_code, response.http_version) == (200, "HTTP/2")
        await _wait_until(lambda: cap.open == 1)  # ``later`` closed: its slot came back


@pytest.mark.anyio
async def test_a_timed_out_handshake_gives_its_slot_back(dev_cert: DevCertificate) -> None:
    cap = ConnectionCap(2)
    async with capped_gateway(dev_cert, cap, handshake_timeout_s=0.3) as port:
        silent = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(2)]
        assert [await _closed_within(stream, 2.0) for stream in silent] == [True, True]
        await _wait_until(lambda: cap.open == 0)
        assert cap.refused == 0  # closed by the handshake timer, not refused
        async with _client(dev_cert, port) as http:
            assert (await http.get("/")).status_code == 200
        for stream in silent:
            await stream.aclose()


@pytest.mark.anyio
async def test_tls_sessions_still_resume_through_the_cap(dev_cert: DevCertificate) -> None:
    context = client_context(dev_cert)
    async with capped_gateway(dev_cert, ConnectionCap(8)) as port:
        first, session, first_reused, _ = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, context, None)
        second, _, second_reused, _ = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, context, session)
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")
    assert (first_reused, second_reused) == (False, True)
