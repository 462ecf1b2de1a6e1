"""A small HTTP/3 client for tests, on aioquic's asyncio API.

One request per QUIC connection. The response keeps each DATA frame as it
arrived, stamped with ``time.monotonic()``, so a test can tell a stream that
trickled (SSE) from one that came in a single burst. It also returns the
session ticket the server issued, to resume a later connection with, and
whether this connection itself resumed one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from aioquic.asyncio import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent
from aioquic.tls import SessionTicket


@dataclass(frozen=True)
class H3Chunk:
    data: bytes
    received_at: float  # time.monotonic()


@dataclass
class H3Response:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[H3Chunk] = field(default_factory=list)
    session_ticket: SessionTicket | None = None
    session_resumed: bool = False
    alpn_protocol: str | None = None

    @property
    def body(self) -> bytes:
        return b"".join(chunk.data for chunk in self.chunks)

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.headers:
            if key == wanted:
                return value.decode()
        return None


class _H3ClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.response = H3Response()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.stream_id: int | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.response.session_resumed = event.session_resumed
            self.response.alpn_protocol = event.alpn_protocol
        elif isinstance(event, ConnectionTerminated) and not self.done.done():
            self.done.set_exception(ConnectionError(f"QUIC closed: {event.reason_phrase}"))
        for h3_event in self.h3.handle_event(event):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        if getattr(event, "stream_id", None) != self.stream_id:
            return
        if isinstance(event, HeadersReceived):
            self._take_headers(event.headers)
        elif isinstance(event, DataReceived) and event.data:
            self.response.chunks.append(H3Chunk(event.data, time.monotonic()))
        if getattr(event, "stream_ended", False) and not self.done.done():
            self.done.set_result(None)

    def _take_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        for name, value in headers:
            if name == b":status":
                self.response.status = int(value)
            else:
                self.response.headers.append((name, value))


async def h3_request(
    host: str,
    port: int,
    method: str = "GET",
    path: str = "/",
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    cafile: Path,
    session_ticket: SessionTicket | None = None,
    server_name: str | None = None,
    timeout_s: float = 10.0,
    ticket_wait_s: float = 1.0,
) -> H3Response:
    """Send one request over a fresh QUIC connection and read the whole response.

    The server sends its ticket once it has the client's Finished, which can
    land after a short response; up to ``ticket_wait_s`` is spent waiting.
    """
    configuration = QuicConfiguration(
        is_client=True,
        alpn_protocols=H3_ALPN,
        server_name=server_name or host,
        session_ticket=session_ticket,
    )
    configuration.load_verify_locations(cafile=str(cafile))
    tickets: list[SessionTicket] = []
    with anyio.fail_after(timeout_s):
        async with connect(
            host,
            port,
            configuration=configuration,
            create_protocol=_H3ClientProtocol,
            session_ticket_handler=tickets.append,
        ) as client:
            assert isinstance(client, _H3ClientProtocol)
            _send_request(client, host, port, method, path, headers, body)
            await client.done
            await _wait_for_ticket(tickets, ticket_wait_s)
    client.response.session_ticket = tickets[-1] if tickets else None
    return client.response


def _send_request(
    client: _H3ClientProtocol,
    host: str,
    port: int,
    method: str,
    path: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
) -> None:
    stream_id = client._quic.get_next_available_stream_id()
    client.stream_id = stream_id
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    pseudo = [(b":method", method.encode()), (b":scheme", b"https")]
    pseudo += [(b":authority", authority.encode()), (b":path", path.encode())]
    extra = [(name.lower().encode(), value.encode()) for name, value in headers]
    client.h3.send_headers(stream_id, pseudo + extra, end_stream=not body)
    if body:
        client.h3.send_data(stream_id, body, end_stream=True)
    client.transmit()


async def _wait_for_ticket(tickets: list[SessionTicket], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not tickets and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def h3_stream_then_leave(
    host: str,
    port: int,
    path: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    *,
    cafile: Path,
    read_bytes: int,
    how: str,
    server_name: str | None = None,
    timeout_s: float = 30.0,
) -> H3Response:
    """Start a streamed request, read at least ``read_bytes`` of its answer, then
    leave: ``how="reset"`` abandons the request's stream as a browser's
    ``AbortController`` does (STOP_SENDING and RESET_STREAM, H3_REQUEST_CANCELLED);
    ``how="close"`` closes the whole QUIC connection. The response so far."""
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                      server_name=server_name or host)
    configuration.load_verify_locations(cafile=str(cafile))
    with anyio.fail_after(timeout_s):
        async with connect(host, port, configuration=configuration,
                           create_protocol=_H3ClientProtocol) as client:
            assert isinstance(client, _H3ClientProtocol)
            _send_request(client, host, port, "POST", path, headers, body)
            while len(client.response.body) < read_bytes and not client.done.done():
                await asyncio.sleep(0.01)
            assert client.stream_id is not None
            if not client.done.done():  # leaving: the end of the connection is no error
                client.done.set_result(None)
            if how == "reset":
                cancelled = 0x010C  # H3_REQUEST_CANCELLED (RFC 9114 8.1)
                client._quic.stop_stream(client.stream_id, cancelled)
                try:  # the request was sent whole: resetting its side may be refused
                    client._quic.reset_stream(client.stream_id, cancelled)
                except (AssertionError, ValueError):
                    pass
                client.transmit()
                await asyncio.sleep(0.2)  # the frames leave before the connection is dropped
            else:
                client.close(error_code=0x0100)  # H3_NO_ERROR
    return client.response
