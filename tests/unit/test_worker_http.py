"""The gateway's worker HTTP client against real sockets on 127.0.0.1:0.

Each test runs a tiny asyncio server whose answer is a script of raw byte
writes (with pauses, so chunk boundaries really fall across reads), and checks
what the gateway would notice: the body it decodes, how many connections the
server saw, and which ``UpstreamFailed`` code an upstream failure becomes.
The chunked decoder is also fed every split of a body, without sockets.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.corridor.attempt import UpstreamCall, start_attempt
from gateway.edge.devcert import ensure_dev_certificate
from gateway.upstream.http1 import ChunkedBody, ConnectionBroken, ProtocolError
from gateway.upstream.client import WorkerClient
from gateway.upstream.worker_http import HttpPool, PoolLimits
from hedgerow.errors import HedgerowError, UpstreamFailed, UpstreamModelNotFound, UpstreamRejected
from hedgerow.wire import WorkerLoad, WorkerRecord, WorkerRegistration
from policies.schema import Timeouts

pytestmark = pytest.mark.anyio

Writes = list[bytes | float]  # bytes to send, or seconds to pause
Script = Callable[[int, int], Writes]  # (connection number, request number on it) -> writes

HEAD_CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")


def fixed(body: bytes, status: int = 200, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, len(body), extra, body))


@dataclass
class Server:
    script: Script
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)  # bodies received
    closed_by_client: int = 0  # connections that reached EOF from the client's side
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        self.tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            for index in range(100):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client += 1
                    return
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(await reader.readexactly(length))
                if not await self._answer(writer, self.script(number, index)):
                    return
        except ConnectionError:
            self.closed_by_client += 1
        except asyncio.CancelledError:
            pass  # the test is over; a cancelled handler task only makes asyncio log noise
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, writes: Writes) -> bool:
        """Play the script; False when it ends with ``b""`` (close the connection)."""
        for item in writes:
            if isinstance(item, float):
                await asyncio.sleep(item)
            elif item == b"":
                return False
            else:
                writer.write(item)
                await writer.drain()
        return True


@asynccontextmanager
async def serving(script: Script, tls: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    server = Server(script)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0, ssl=tls)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()
        for task in server.tasks:
            task.cancel()
        await asyncio.gather(*server.tasks, return_exceptions=True)


def client(idle_ms: int = 2000) -> WorkerClient:
    return WorkerClient(Timeouts(connect_ms=1000, ttft_ms=5000, idle_ms=idle_ms))


async def stream_text(workers: WorkerClient, url: str, *, rid: str = "r1") -> bytes:
    response = await workers.open_stream("w", url, b'{"model":"m"}', rid)
    try:
        return b"".join([data async for data in WorkerClient.chunks("w", response)])
    finally:
        await response.aclose()


async def failure_code(action: Awaitable[object]) -> str:
    with pytest.raises(UpstreamFailed) as caught:
        await action
    return caught.value.code


# -- the chunked decoder, sans-IO ----------------------------------------------------------

CHUNKED = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n"


@pytest.mark.parametrize("split", range(1, len(CHUNKED)))
def test_chunked_decoding_is_the_same_wherever_a_read_ends(split: int) -> None:
    body, buffer = ChunkedBody(), bytearray(CHUNKED[:split])
    decoded = body.decode(buffer)
    buffer += CHUNKED[split:]
    decoded += body.decode(buffer)
    assert decoded == b"hello, world" and body.done and not buffer


@pytest.mark.parametrize("bad", [b"zz\r\nhello\r\n", b"3\r\nhello\r\n0\r\n\r\n", b"-1\r\n"])
def test_a_malformed_chunked_body_is_rejected(bad: bytes) -> None:
    with pytest.raises(ProtocolError):
        ChunkedBody().decode(bytearray(bad))


def test_a_chunked_body_cut_short_is_a_broken_connection() -> None:
    body = ChunkedBody()
    body.decode(bytearray(b"5\r\nhel"))
    with pytest.raises(ConnectionBroken):
        body.at_eof()


# -- framing over real sockets -------------------------------------------------------------

async def test_chunked_body_split_across_reads_is_decoded_whole() -> None:
    writes: Writes = [HEAD_CHUNKED[:20], 0.01, HEAD_CHUNKED[20:] + b"9\r\ndata: ", 0.01,
                      b"a\n\n\r", 0.01, b"\n0", 0.01, b"e\r\ndata: [DONE]\n\n\r\n0\r\n", 0.01,
                      b"\r\n"]
    async with serving(lambda c, r: writes) as server:
        workers = client()
        assert await stream_text(workers, server.url) == b"data: a\n\ndata: [DONE]\n\n"
        assert await stream_text(workers, server.url) == b"data: a\n\ndata: [DONE]\n\n"
        await workers.aclose()
    assert server.connections == 1  # the fully read chunked response kept it alive


async def test_content_length_body_and_request_as_sent() -> None:
    async with serving(lambda c, r: [fixed(b'{"ok":true}')]) as server:
        workers = client()
        response = await workers.open_stream("w", server.url, b'{"model":"m"}', "r1",
                                             {"authorization": "Bearer k"})
        assert response.status == 200 and response.headers["content-type"] == "application/json"
        assert await WorkerClient.read_all("w", response) == b'{"ok":true}'
        await workers.aclose()
    assert server.requests == [b'{"model":"m"}']


async def test_close_delimited_body_is_read_to_eof_and_not_reused() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n"
    async with serving(lambda c, r: [head, b"first ", 0.01, b"second", b""]) as server:
        workers = client()
        assert await stream_text(workers, server.url) == b"first second"
        assert await stream_text(workers, server.url) == b"first second"
        await workers.aclose()
    assert server.connections == 2


async def test_connection_close_header_is_honoured() -> None:
    async with serving(lambda c, r: [fixed(b"x", extra=b"connection: close\r\n")]) as server:
        workers = client()
        for _ in range(2):
            assert await stream_text(workers, server.url) == b"x"
        await workers.aclose()
    assert server.connections == 2


# -- the pool ------------------------------------------------------------------------------

async def test_sequential_requests_share_one_connection() -> None:
    async with serving(lambda c, r: [fixed(b"%d:%d" % (c, r))]) as server:
        workers = client()
        assert await stream_text(workers, server.url) == b"0:0"
        assert await stream_text(workers, server.url) == b"0:1"
        await workers.aclose()
    assert server.connections == 1


async def test_an_idle_connection_past_its_expiry_is_not_reused() -> None:
    async with serving(lambda c, r: [fixed(b"%d" % c)]) as server:
        pool = HttpPool(PoolLimits(idle_expiry_s=0.1))
        bodies = []
        for pause in (0.0, 0.0, 0.2):
            await asyncio.sleep(pause)
            response = await pool.request("POST", server.url, {}, b"{}")
            bodies.append(await response.read_all(100))
        await pool.aclose()
    assert bodies == [b"0", b"0", b"1"] and server.connections == 2


async def test_an_abandoned_stream_closes_its_connection() -> None:
    writes: Writes = [HEAD_CHUNKED, b"3\r\none\r\n", 0.3, b"3\r\ntwo\r\n0\r\n\r\n"]
    async with serving(lambda c, r: writes) as server:
        workers = client()
        response = await workers.open_stream("w", server.url, b"{}", "r1")
        first = await anext(WorkerClient.chunks("w", response))
        await response.aclose()  # the client hung up after one token
        assert first == b"one"
        await asyncio.sleep(0.45)  # the server finds out when its script is played
        assert server.closed_by_client == 1
        response = await workers.open_stream("w", server.url, b"{}", "r2")
        await response.aclose()
        await workers.aclose()
    assert server.connections == 2


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one() -> None:
    # The first connection answers once, then dies on the next request unanswered:
    # the server dropped an idle keep-alive connection just as it was reused.
    def script(conn: int, index: int) -> Writes:
        return [b""] if conn == 0 and index == 1 else [fixed(b"ok %d" % conn)]

    async with serving(script) as server:
        workers = client()
        assert await stream_text(workers, server.url) == b"ok 0"
        assert await stream_text(workers, server.url) == b"ok 1"
        await workers.aclose()
    assert server.connections == 2 and len(server.requests) == 3


async def test_a_fresh_connection_that_dies_unanswered_is_not_retried() -> None:
    async with serving(lambda c, r: [b""]) as server:
        workers = client()
        code = await failure_code(workers.open_stream("w", server.url, b"{}", "r1"))
        await workers.aclose()
    assert code == "upstream_unreachable" and server.connections == 1


async def test_a_response_cut_off_after_its_first_bytes_is_not_retried() -> None:
    def script(conn: int, index: int) -> Writes:
        return [HEAD_CHUNKED[:10], b""] if index == 1 else [fixed(b"ok")]

    async with serving(script) as server:
        workers = client()
        await stream_text(workers, server.url)
        code = await failure_code(workers.open_stream("w", server.url, b"{}", "r2"))
        await workers.aclose()
    assert code == "upstream_unreachable" and server.connections == 1


async def test_the_pool_bounds_connections_per_worker() -> None:
    async with serving(lambda c, r: [0.05, fixed(b"%d" % c)]) as server:
        pool = HttpPool(PoolLimits(connect_s=1.0, idle_s=1.0, max_connections=1))

        async def one() -> bytes:
            response = await pool.request("POST", server.url, {}, b"{}")
            return await response.read_all(100)

        bodies = await asyncio.gather(one(), one(), one())
        await pool.aclose()
    assert list(bodies) == [b"0", b"0", b"0"] and server.connections == 1


# -- failures, as the gateway sees them ----------------------------------------------------

async def test_connection_refused_is_upstream_unreachable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = client()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    assert await failure_code(workers.open_stream("w", url, b"{}", "r1")) == "upstream_unreachable"


async def test_a_silent_worker_mid_stream_is_upstream_timeout() -> None:
    writes: Writes = [HEAD_CHUNKED, b"3\r\none\r\n", 5.0]
    async with serving(lambda c, r: writes) as server:
        workers = client(idle_ms=150)
        started = asyncio.get_running_loop().time()
        code = await failure_code(stream_text(workers, server.url))
        waited = asyncio.get_running_loop().time() - started
        await workers.aclose()
    assert code == "upstream_timeout" and 0.14 < waited < 1.0


async def test_a_worker_silent_before_its_head_is_upstream_timeout() -> None:
    async with serving(lambda c, r: [5.0]) as server:
        workers = client(idle_ms=150)
        code = await failure_code(workers.open_stream("w", server.url, b"{}", "r1"))
        await workers.aclose()
    assert code == "upstream_timeout"


async def test_a_5xx_is_upstream_error() -> None:
    async with serving(lambda c, r: [fixed(b"internal error", status=503)]) as server:
        workers = client()
        code = await failure_code(workers.open_stream("w", server.url, b"{}", "r1"))
        await workers.aclose()
    assert code == "upstream_error"


async def test_oversized_headers_are_rejected() -> None:
    huge = b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"a" * 70_000 + b"\r\n\r\n"
    async with serving(lambda c, r: [huge]) as server:
        workers = client()
        code = await failure_code(workers.open_stream("w", server.url, b"{}", "r1"))
        await workers.aclose()
    assert code == "upstream_malformed"


SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize(("status", "expected", "client_status", "code"), [
    (400, UpstreamRejected, 400, "upstream_rejected_request"),
    (413, UpstreamRejected, 400, "upstream_rejected_request"),
    (422, UpstreamRejected, 400, "upstream_rejected_request"),
    (401, UpstreamFailed, 502, "upstream_error"),
    (404, UpstreamModelNotFound, 404, "model_not_found"),
    (302, UpstreamFailed, 502, "upstream_error"),
    (429, UpstreamFailed, 502, "upstream_error"),
    (500, UpstreamFailed, 502, "upstream_error"),
    (206, UpstreamFailed, 502, "upstream_malformed"),
])
async def test_a_non_200_answer_becomes_our_error_without_the_workers_words(
    status: int, expected: type[HedgerowError], client_status: int, code: str,
) -> None:
    """The operator's log gets the status and the body; the client's envelope neither."""
    def body(port: int) -> bytes:
        return (f'{{"error":{{"message":"max_tokens too large at http://127.0.0.1:{port} '
                f'key={SECRET}","code":"invalid_value"}}}}').encode()

    async with serving(lambda c, r: [fixed(body(server.port), status=status)]) as server:
        registration = WorkerRegistration(worker_id="w-secret-id",
                                          url=f"http://127.0.0.1:{server.port}",
                                          kind="cpu", models=("m",), slots=1)
        worker = WorkerRecord(registration=registration, load=WorkerLoad(),
                              lease_expires_in_s=30.0)
        call = UpstreamCall("r1", "/v1/chat/completions", b'{"model":"m"}', "m")
        workers = client()
        with pytest.raises(expected) as caught:
            await start_attempt(workers, worker, call, hedged=False, ttft_timeout_s=2.0)
        await workers.aclose()
    error = caught.value
    assert type(error) is expected
    assert (error.status, error.code) == (client_status, code)
    detail: str = error.detail  # type: ignore[attr-defined]
    assert f"answered {status}" in detail and SECRET in detail  # for the operator
    public = str(error.envelope())
    for leak in (str(server.port), "127.0.0.1", "w-secret-id", SECRET, "max_tokens too"):
        assert leak not in public


async def test_https_with_a_private_ca(tmp_path: Path) -> None:
    cert = ensure_dev_certificate(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert.cert, cert.key)
    async with serving(lambda c, r: [fixed(b"secret")], tls=server_tls) as server:
        pool = HttpPool(ssl_context=ssl.create_default_context(cafile=str(cert.ca_cert)))
        for _ in range(2):
            response = await pool.request("POST", f"https://localhost:{server.port}/x", {}, b"{}")
            assert await response.read_all(100) == b"secret"
        await pool.aclose()
    assert server.connections == 1


# -- a worker's odd framing headers: a malformed reply (retried elsewhere), never a crash ------

OK_BODY = b'{"ok":true}'


@pytest.mark.parametrize("framing", [
    b"content-length: \xb2\r\n",  # latin-1 for the superscript two: str.isdigit() is True
    b"content-length: \xd9\xa3\r\n",  # an Arabic-Indic digit, in UTF-8
    b"content-length: +11\r\n",
    b"content-length: -11\r\n",
    b"content-length: 1_1\r\n",
    b"content-length: 11\xa0\r\n",  # NBSP is not optional whitespace
    b"content-length: " + b"9" * 5000 + b"\r\n",  # int() refuses more than 4,300 digits
    b"content-length: 11\r\ncontent-length: 12\r\n",
    b"content-length: 11, 12\r\n",
    b"content-length: \r\n",
    b"transfer-encoding: chunked\r\ncontent-length: 11\r\n",
], ids=["superscript", "arabic-indic", "plus", "minus", "underscore", "nbsp", "5000-digits",
        "two-lengths", "two-lengths-one-line", "empty", "te-and-cl"])
async def test_a_reply_with_odd_framing_headers_is_a_malformed_upstream(framing: bytes) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + framing + b"\r\n"
    async with serving(lambda c, r: [head + OK_BODY]) as server:
        workers = client()
        code = await failure_code(workers.open_stream("w", server.url, b"{}", "r1"))
        await workers.aclose()
    assert code == "upstream_malformed"


async def test_transfer_encoding_in_an_http10_reply_is_a_malformed_upstream() -> None:
    head = b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    async with serving(lambda c, r: [head + b"b\r\n" + OK_BODY + b"\r\n0\r\n\r\n"]) as server:
        workers = client()
        code = await failure_code(workers.open_stream("w", server.url, b"{}", "r1"))
        await workers.aclose()
    assert code == "upstream_malformed"


@pytest.mark.parametrize("framing", [
    b"content-length: 11\r\n",
    b"content-length:   11 \t\r\n",
    b"content-length: 11\r\ncontent-length: 11\r\n",  # identical copies are allowed
    b"content-length: 11, 11\r\n",
], ids=["plain", "spaces", "repeated", "repeated-one-line"])
async def test_lenient_but_unambiguous_content_lengths_are_read(framing: bytes) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + framing + b"\r\n"
    async with serving(lambda c, r: [head + OK_BODY]) as server:
        workers = client()
        response = await workers.open_stream("w", server.url, b"{}", "r1")
        body = await WorkerClient.read_all("w", response)
        await workers.aclose()
    assert body == OK_BODY
