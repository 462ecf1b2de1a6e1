"""HTTP/3 for the load generator: one QUIC connection carrying many requests (aioquic).

``H3Client`` opens one QUIC connection (TLS 1.3, ALPN ``h3``) and multiplexes
every request on it, as a browser would. ``client.stream(...)`` is an async
context manager yielding an ``H3Response`` whose surface is the part of
``httpx.Response`` the load generator reads: ``status_code``,
``http_version``, ``headers``, ``aiter_bytes()`` and ``aread()``. A lost
connection or a reset stream raises ``H3Error`` (a ``ConnectionError``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

_END = b""  # queued after a stream's last DATA frame


class H3Error(ConnectionError):
    """The QUIC connection closed, or the server reset the request's stream."""


@dataclass
class _Stream:
    headers: asyncio.Future[list[tuple[bytes, bytes]]]
    chunks: asyncio.Queue[bytes | H3Error] = field(default_factory=asyncio.Queue)


class _Protocol(QuicConnectionProtocol):
    """Routes HTTP/3 events to the ``_Stream`` of each request in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.streams: dict[int, _Stream] = {}
        self.closed: H3Error | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            self.closed = H3Error(f"QUIC connection closed: {event.reason_phrase or event.error_code}")
            for stream_id in list(self.streams):
                self._fail(stream_id, self.closed)
        elif isinstance(event, StreamReset):
            self._fail(event.stream_id, H3Error(f"stream reset with code {event.error_code}"))
        for h3_event in self.h3.handle_event(event):
            self._deliver(h3_event)

    def _deliver(self, event: H3Event) -> None:
        stream = self.streams.get(getattr(event, "stream_id", -1))
        if stream is None:
            return
        if isinstance(event, HeadersReceived) and not stream.headers.done():
            stream.headers.set_result(event.headers)
        elif isinstance(event, DataReceived) and event.data:
            stream.chunks.put_nowait(event.data)
        if getattr(event, "stream_ended", False):
            stream.chunks.put_nowait(_END)

    def _fail(self, stream_id: int, error: H3Error) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if not stream.headers.done():
            stream.headers.set_exception(error)
        stream.chunks.put_nowait(error)


class H3Response:
    """One request's response, read as it streams in."""

    http_version = "HTTP/3"

    def __init__(self, status: int, headers: Mapping[str, str], stream: _Stream) -> None:
        self.status_code = status
        self.headers = headers
        self._stream = stream

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self._stream.chunks.get()
            if isinstance(chunk, H3Error):
                raise chunk
            if chunk == _END:
                return
            yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])


class H3Client:
    """One QUIC connection to ``base_url``'s host and port; ``aclose()`` closes it."""

    def __init__(self, base_url: str, ca_file: Path | None, headers: Mapping[str, str]) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 443
        self.ca_file = ca_file
        self.default_headers = dict(headers)
        self._exits = AsyncExitStack()
        self._protocol: _Protocol | None = None

    async def connect(self) -> None:
        configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                          server_name=self.host, max_datagram_frame_size=65536)
        if self.ca_file is not None:  # else aioquic's default trust (certifi)
            configuration.load_verify_locations(cafile=str(self.ca_file))
        protocol = await self._exits.enter_async_context(
            connect(self.host, self.port, configuration=configuration, create_protocol=_Protocol))
        assert isinstance(protocol, _Protocol)
        self._protocol = protocol

    async def aclose(self) -> None:
        self._protocol = None
        await self._exits.aclose()

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, content: bytes,
                     headers: Mapping[str, str]) -> AsyncIterator[H3Response]:
        protocol = self._protocol
        if protocol is None or protocol.closed is not None:
            raise H3Error(str(protocol.closed) if protocol else "not connected")
        stream_id = protocol._quic.get_next_available_stream_id()
        stream = _Stream(asyncio.get_running_loop().create_future())
        protocol.streams[stream_id] = stream
        try:
            self._send(protocol, stream_id, method, path, content, headers)
            raw = await stream.headers
            yield _response(raw, stream)
        finally:
            protocol.streams.pop(stream_id, None)

    def _send(self, protocol: _Protocol, stream_id: int, method: str, path: str,
              content: bytes, headers: Mapping[str, str]) -> None:
        fields = [(b":method", method.encode()), (b":scheme", b"https"),
                  (b":authority", f"{self.host}:{self.port}".encode()), (b":path", path.encode())]
        merged = {**self.default_headers, **headers}
        fields += [(name.lower().encode(), value.encode()) for name, value in merged.items()]
        protocol.h3.send_headers(stream_id, fields, end_stream=not content)
        if content:
            protocol.h3.send_data(stream_id, content, end_stream=True)
        protocol.transmit()


def _response(raw: list[tuple[bytes, bytes]], stream: _Stream) -> H3Response:
    status = 0
    headers: dict[str, str] = {}
    for name, value in raw:
        if name == b":status":
            status = int(value)
        elif not name.startswith(b":"):
            headers[name.decode()] = value.decode()
    return H3Response(status, headers, stream)
