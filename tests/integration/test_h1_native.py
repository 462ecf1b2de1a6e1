"""``hedgerow.h1``: the gateway's transport serving HTTP/1.1 itself (``--http1 native``).

Real TLS connections to ``gateway.edge.transport.serve``; raw bytes where a
client library would hide what the server framed (pipelining, a malformed
head, a head over the limit), httpx where a client would just use it. HTTP/2
clients on the same port still reach hypercorn.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import httpx
import pytest

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.transport import build_config, serve
from hedgerow.asgi import DISCONNECT_EXTENSION, handle_lifespan
from hedgerow.connection_cap import ConnectionCap

pytestmark = pytest.mark.anyio

Message = dict[str, Any]
LEFT: list[str] = []  # paths whose client left mid-stream, as the app saw it


@pytest.fixture(scope="module")
def dev_cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("state"))


async def app(scope: Message, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await handle_lifespan(receive, send)
        return
    path = scope["path"]
    if path == "/echo":  # the whole body back, with what the server said about it
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-version", scope["http_version"].encode()),
                                (b"x-query", scope["query_string"])]})
        await send({"type": "http.response.body", "body": body})
    elif path == "/stream":
        left = anyio.Event()
        scope["extensions"][DISCONNECT_EXTENSION].on_disconnect(left.set)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for index in range(int(scope["query_string"] or b"5")):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % index,
                        "more_body": True})
            with anyio.move_on_after(0.02):
                await left.wait()
            if left.is_set():
                LEFT.append(path)
                return
        await send({"type": "http.response.body", "body": b""})
    elif path == "/fail-before":
        raise RuntimeError("the app failed before answering")
    elif path == "/fail-during":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("the app failed mid-answer")
    elif path == "/headers":  # the header names the app was given, after the whole body
        while (await receive()).get("more_body"):
            pass
        names = b",".join(name for name, _ in scope["headers"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(names))]})
        await send({"type": "http.response.body", "body": names})
    elif path == "/early":  # refuses the upload without reading it
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-length", b"8")]})
        await send({"type": "http.response.body", "body": b"too big\n"})
    elif path == "/overshoot":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok", "more_body": True})
        await send({"type": "http.response.body",
                    "body": b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nevil"})
    elif path == "/inject":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-bad", b"a\r\nset-cookie: stolen=1")]})
        await send({"type": "http.response.body", "body": b"x"})
    else:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})


@asynccontextmanager
async def native(cert: DevCertificate, *, keep_alive_s: float = 5.0,
                 max_requests: int = 10_000) -> AsyncIterator[int]:
    config = build_config(host="127.0.0.1", port=0, certfile=cert.cert, keyfile=cert.key,
                          http3=False, native_http1=True, graceful_timeout_s=2.0,
                          max_requests_per_connection=max_requests)
    config.keep_alive_timeout = keep_alive_s
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve(
            app, config, stop.wait, connection_cap=ConnectionCap(64), task_status=task_status))
        try:
            yield port
        finally:
            stop.set()


def client_context(cert: DevCertificate, alpn: list[str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cert.ca_cert))
    context.set_alpn_protocols(alpn or ["http/1.1"])
    return context


@contextmanager
def tls_socket(cert: DevCertificate, port: int, alpn: list[str] | None = None
               ) -> Iterator[ssl.SSLSocket]:
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with client_context(cert, alpn).wrap_socket(raw, server_hostname="localhost") as tls:
        yield tls


def read_until_closed(tls: ssl.SSLSocket, timeout_s: float = 5.0) -> bytes:
    tls.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = tls.recv(65536)
        except (ssl.SSLError, ConnectionResetError):
            return data
        if not chunk:
            return data
        data += chunk


def read_response(tls: ssl.SSLSocket) -> bytes:
    """One response whose body has a content-length."""
    tls.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += tls.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += tls.recv(65536)
    return head + b"\r\n\r\n" + rest[:length]


async def in_thread(function: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(function, *args)


async def test_httpx_over_http1_gets_answers_streams_and_echoes_on_one_connection(
        dev_cert: DevCertificate) -> None:
    async with native(dev_cert) as port:
        async with httpx.AsyncClient(verify=client_context(dev_cert), http2=False) as client:
            base = f"https://localhost:{port}"
            first = await client.get(base + "/")
            assert (first.status_code, first.text, first.http_version) == (200, "hello", "HTTP/1.1")
            assert first.headers["date"] and first.headers["content-length"] == "5"
            echoed = await client.post(base + "/echo?x=1", content=b"a" * 200_000)
            assert echoed.content == b"a" * 200_000 and echoed.headers["x-query"] == "x=1"

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(3):
                    yield b"part "
            assert (await client.post(base + "/echo", content=chunks())).content == b"part " * 3
            arrivals = []
            async with client.stream("GET", base + "/stream?5") as stream:
                assert stream.headers["transfer-encoding"] == "chunked"
                async for chunk in stream.aiter_raw():
                    arrivals.append((time.monotonic(), chunk))
            assert b"".join(c for _, c in arrivals) == b"".join(b"data: %d\n\n" % i
                                                               for i in range(5))
            assert arrivals[-1][0] - arrivals[0][0] > 0.05  # streamed, not buffered
            assert (await client.get(base + "/")).text == "hello"  # the same connection serves on


async def test_an_http2_client_on_the_same_port_is_served_by_hypercorn(
        dev_cert: DevCertificate) -> None:
    async with native(dev_cert) as port:
        async with httpx.AsyncClient(verify=client_context(dev_cert, ["h2", "http/1.1"]),
                                     http2=True) as client:
            answer = await client.post(f"https://localhost:{port}/echo", content=b"hi")
            assert (answer.http_version, answer.content) == ("HTTP/2", b"hi")
            assert answer.headers["x-version"] == "2"


async def test_pipelined_requests_are_answered_in_order(dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> list[bytes]:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\none"
                        b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
                        b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                        b"5\r\nthree\r\n0\r\n\r\n")
            return [read_response(tls) for _ in range(3)]
    async with native(dev_cert) as port:
        answers = await in_thread(exchange, port)
    assert [answer.rsplit(b"\r\n\r\n", 1)[1] for answer in answers] == [b"one", b"hello",
                                                                         b"three"]


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000 + b"\r\n\r\n", b"431"),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(3000)) + b"\r\n",
     b"431"),
    (b"GET / HTTP/1.1\r\n\r\n", b"400"),  # HTTP/1.1 without host
    (b"NOT-HTTP\r\n\r\n", b"400"),
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
     b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),  # both framings: smuggling
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
     b"400"),
    (b"GET / HTTP/1.1\r\nhost: x\r\nbad header: 1\r\n\r\n", b"400"),
    (b"GET / HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", b"400"),
    (b"GET / HTTP/2.0\r\nhost: x\r\n\r\n", b"505"),
    (b"POST /echo HTTP/1.0\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n"
     b"3\r\nabc\r\n0\r\n\r\nGET / HTTP/1.0\r\n\r\n", b"400"),  # RFC 9112 6.1
    # A trailer or a chunk extension that never ends (llhttp would hold it all).
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
     b"1\r\nx\r\n0\r\nx-trailer: " + b"a" * 80_000, b"431"),
    (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
     b"1;ext=" + b"a" * 80_000, b"431"),
])
async def test_a_bad_head_gets_its_status_and_the_connection_closes(
        dev_cert: DevCertificate, request_bytes: bytes, status: bytes) -> None:
    def exchange(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            try:
                for start in range(0, len(request_bytes), 8192):  # as a network would
                    tls.sendall(request_bytes[start:start + 8192])
            except (ssl.SSLError, OSError):
                pass  # refused while still sending
            return read_until_closed(tls)
    async with native(dev_cert) as port:
        answer = await in_thread(exchange, port)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert b"connection: close" in answer.lower()


async def test_a_header_that_never_ends_is_refused_once_over_the_limit(
        dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-long: ")
            try:
                for _ in range(200):  # 800 KB of one header value, no line end
                    tls.sendall(b"a" * 4096)
            except (ssl.SSLError, OSError):
                pass  # refused and closed while still sending
            return read_until_closed(tls)
    async with native(dev_cert) as port:
        answer = await in_thread(exchange, port)
    assert answer.startswith(b"HTTP/1.1 431")


async def test_a_head_trickled_slower_than_the_keep_alive_timeout_is_cut(
        dev_cert: DevCertificate) -> None:
    def slowloris(port: int) -> tuple[float, bytes]:
        with tls_socket(dev_cert, port) as tls:
            started = time.monotonic()
            tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")
            tls.settimeout(0.2)
            data = b""
            for _ in range(40):  # a header line every 0.2 s, never the blank line
                try:
                    tls.sendall(b"x-a: b\r\n")
                    chunk = tls.recv(1024)
                except (ssl.SSLError, OSError) as error:
                    if isinstance(error, socket.timeout):
                        continue
                    break
                if not chunk:
                    break
                data += chunk
            return time.monotonic() - started, data
    async with native(dev_cert, keep_alive_s=1.0) as port:
        elapsed, data = await in_thread(slowloris, port)
    assert data == b"" and 0.9 < elapsed < 4.0


async def test_an_idle_connection_closes_after_the_keep_alive_timeout(
        dev_cert: DevCertificate) -> None:
    def idle(port: int) -> tuple[bytes, float, bytes]:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            first = read_response(tls)
            started = time.monotonic()
            rest = read_until_closed(tls)
            return first, time.monotonic() - started, rest
    async with native(dev_cert, keep_alive_s=0.5) as port:
        first, waited, rest = await in_thread(idle, port)
    assert first.endswith(b"hello") and rest == b"" and 0.4 < waited < 3.0


async def test_http10_gets_a_close_delimited_stream_and_keep_alive_only_when_asked(
        dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> tuple[bytes, bytes]:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"GET /stream?3 HTTP/1.0\r\n\r\n")
            streamed = read_until_closed(tls)
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
            kept = read_response(tls)
        return streamed, kept
    async with native(dev_cert) as port:
        streamed, kept = await in_thread(exchange, port)
    head, _, body = streamed.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert b"connection: keep-alive" in kept.lower() and kept.endswith(b"hello")


async def test_head_expect_continue_and_the_last_request_of_a_connection(
        dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> tuple[bytes, bytes, bytes, bytes]:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n")
            tls.settimeout(5)
            head = tls.recv(65536)
            tls.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                        b"content-length: 2\r\n\r\n")
            interim = tls.recv(65536)
            tls.sendall(b"ok")
            echoed = read_response(tls)
            tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            last = read_until_closed(tls)
        return head, interim, echoed, last
    async with native(dev_cert, max_requests=3) as port:
        head, interim, echoed, last = await in_thread(exchange, port)
    assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")  # no body
    assert b"content-length: 5" in head.lower()
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert echoed.endswith(b"\r\n\r\nok")
    assert b"connection: close" in last.lower() and last.endswith(b"hello")


async def test_a_failing_app_gets_a_500_or_a_cut_and_no_header_is_injected(
        dev_cert: DevCertificate) -> None:
    async with native(dev_cert) as port:
        async with httpx.AsyncClient(verify=client_context(dev_cert)) as client:
            base = f"https://localhost:{port}"
            assert (await client.get(base + "/fail-before")).status_code == 500
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(base + "/fail-during")  # a truncated chunked body
            injected = await client.get(base + "/inject")
            assert injected.status_code == 500 and "set-cookie" not in injected.headers
            assert (await client.get(base + "/")).text == "hello"


async def test_a_client_leaving_mid_stream_fires_the_disconnect_hook(
        dev_cert: DevCertificate) -> None:
    LEFT.clear()

    def leave(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"GET /stream?500 HTTP/1.1\r\nhost: x\r\n\r\n")
            tls.settimeout(5)
            return tls.recv(65536)
    async with native(dev_cert) as port:
        first = await in_thread(leave, port)
        with anyio.fail_after(5):
            while not LEFT:
                await anyio.sleep(0.02)
    assert first.startswith(b"HTTP/1.1 200") and LEFT == ["/stream"]


async def test_connections_take_and_give_back_cap_slots(dev_cert: DevCertificate) -> None:
    config = build_config(host="127.0.0.1", port=0, certfile=dev_cert.cert,
                          keyfile=dev_cert.key, http3=False, native_http1=True)
    cap = ConnectionCap(2)
    stop = anyio.Event()

    def hold_two_then_third(port: int) -> tuple[bytes, bytes]:
        with tls_socket(dev_cert, port) as one, tls_socket(dev_cert, port) as two:
            one.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            two.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answers = (read_response(one), read_response(two))
            try:
                with tls_socket(dev_cert, port) as three:
                    three.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                    refused = read_until_closed(three)
            except (ssl.SSLError, OSError):
                refused = b""
            assert refused == b""
            return answers
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve(
            app, config, stop.wait, connection_cap=cap, task_status=task_status))
        answers = await in_thread(hold_two_then_third, port)
        assert all(answer.endswith(b"hello") for answer in answers) and cap.refused == 1
        with anyio.fail_after(5):
            while cap.open:
                await anyio.sleep(0.02)
        stop.set()


async def test_trailer_fields_never_become_request_headers(dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"POST /headers HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                        b"3\r\nabc\r\n0\r\nauthorization: Bearer evil\r\nhost: b\r\n\r\n")
            return read_response(tls)
    async with native(dev_cert) as port:
        answer = await in_thread(exchange, port)
    assert answer.endswith(b"\r\n\r\nhost,transfer-encoding")


async def test_a_head_of_a_stream_has_no_body_and_the_connection_serves_on(
        dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> tuple[bytes, bytes]:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"HEAD /stream?2 HTTP/1.1\r\nhost: x\r\n\r\n")
            tls.settimeout(5)
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += tls.recv(65536)
            tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            return head, read_response(tls)
    async with native(dev_cert) as port:
        head, after = await in_thread(exchange, port)
    assert head.startswith(b"HTTP/1.1 200") and after.startswith(b"HTTP/1.1 200")
    assert after.endswith(b"hello")  # no stray last-chunk between the two


async def test_a_flood_of_pipelined_requests_is_cut_after_a_bounded_queue(
        dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" * 2000)
            return read_until_closed(tls)
    async with native(dev_cert) as port:
        answers = await in_thread(exchange, port)
    count = answers.count(b"HTTP/1.1 200")
    assert 1 <= count <= 1 + 16 + 1 and answers.endswith(b"hello")  # then it closed


async def test_an_upload_refused_early_still_reads_its_answer(dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 3000000\r\n\r\n")
            time.sleep(0.2)
            try:
                for _ in range(10):  # keeps uploading after the answer (0.3 s of it)
                    tls.sendall(b"z" * 65536)
                    time.sleep(0.03)
            except (ssl.SSLError, OSError):
                pass
            started = time.monotonic()
            answer = read_until_closed(tls)
            assert time.monotonic() - started < 2.5  # and then the connection is freed
            return answer
    async with native(dev_cert) as port:
        answer = await in_thread(exchange, port)
    assert answer.startswith(b"HTTP/1.1 413") and answer.endswith(b"too big\n")


async def test_a_body_longer_than_its_content_length_is_never_sent(
        dev_cert: DevCertificate) -> None:
    def exchange(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"GET /overshoot HTTP/1.1\r\nhost: x\r\n\r\n")
            return read_until_closed(tls)
    async with native(dev_cert) as port:
        answer = await in_thread(exchange, port)
    assert answer.endswith(b"\r\n\r\nok") and b"evil" not in answer


async def test_a_bad_chunk_mid_body_tells_the_app_the_client_left(
        dev_cert: DevCertificate, caplog: pytest.LogCaptureFixture) -> None:
    def exchange(port: int) -> bytes:
        with tls_socket(dev_cert, port) as tls:
            tls.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                        b"1\r\nx\r\n")
            time.sleep(0.2)  # the app is now waiting for more body
            tls.sendall(b"ZZ\r\n")
            return read_until_closed(tls)
    async with native(dev_cert) as port:
        answer = await in_thread(exchange, port)
        await anyio.sleep(0.2)
    assert answer.startswith(b"HTTP/1.1 400")
    assert "the application failed" not in caplog.text
