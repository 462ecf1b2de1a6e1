"""A raw HTTP/2 client for attack tests and the ``attacks`` benchmark: frames built with hyperframe and hpack,
written to a TLS socket as they are, with no client state machine in the way
(h2's would refuse to send most of what an attacker sends).

``RawH2`` writes frames and reads what the server answers, frame by frame,
so a test sees exactly when a GOAWAY (and with what error code) arrives and
when the connection closes.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from dataclasses import dataclass, field

from h2.errors import ErrorCodes
from hpack import Encoder
from hyperframe.frame import (ContinuationFrame, DataFrame, Frame, GoAwayFrame, HeadersFrame,
                              PingFrame, PriorityFrame, RstStreamFrame, SettingsFrame,
                              WindowUpdateFrame)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = 9


@dataclass
class ServerSaid:
    """What the server sent so far."""

    goaway_code: int | None = None
    goaway_last_stream: int | None = None
    goaway_at: float = 0.0
    closed_at: float = 0.0
    frames: dict[str, int] = field(default_factory=dict)
    ended_streams: set[int] = field(default_factory=set)
    reset_streams: dict[int, int] = field(default_factory=dict)
    data: dict[int, bytearray] = field(default_factory=dict)

    @property
    def cut(self) -> bool:
        return self.goaway_code is not None or self.closed_at > 0

    @property
    def calmed(self) -> bool:
        return self.goaway_code == ErrorCodes.ENHANCE_YOUR_CALM


class RawH2:
    """One TLS connection speaking HTTP/2 frame by frame."""

    def __init__(self, port: int, cafile: str, *, settings: dict[int, int] | None = None,
                 host: str = "127.0.0.1", auto_window: bool = True) -> None:
        context = ssl.create_default_context(cafile=cafile)
        context.set_alpn_protocols(["h2"])
        raw = socket.create_connection((host, port), timeout=10)
        self.sock = context.wrap_socket(raw, server_hostname="localhost")
        assert self.sock.selected_alpn_protocol() == "h2"
        self.encoder = Encoder()
        self.next_stream = 1
        self.said = ServerSaid()
        # Credit every DATA byte back at once (a well-behaved reader); off for
        # a client that wants the server's windows to run dry.
        self.auto_window = auto_window
        self._buffer = bytearray()
        self.sock.sendall(PREFACE + SettingsFrame(0, settings=settings or {}).serialize())

    def new_stream(self) -> int:
        stream_id = self.next_stream
        self.next_stream += 2
        return stream_id

    def request_headers(self, stream_id: int, path: str = "/v1/models", method: str = "GET",
                        end_stream: bool = True,
                        extra: list[tuple[str, str]] | None = None) -> HeadersFrame:
        headers = [(":method", method), (":scheme", "https"), (":authority", "localhost"),
                   (":path", path)] + (extra or [])
        frame = HeadersFrame(stream_id, self.encoder.encode(headers))
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame

    @staticmethod
    def rst(stream_id: int, code: int = ErrorCodes.CANCEL) -> RstStreamFrame:
        return RstStreamFrame(stream_id, error_code=code)

    @staticmethod
    def ping(n: int) -> PingFrame:
        return PingFrame(0, opaque_data=struct.pack(">Q", n))

    @staticmethod
    def priority(stream_id: int, depends_on: int = 0) -> PriorityFrame:
        return PriorityFrame(stream_id, depends_on=depends_on, stream_weight=15)

    @staticmethod
    def settings(values: dict[int, int]) -> SettingsFrame:
        return SettingsFrame(0, settings=values)

    @staticmethod
    def data(stream_id: int, payload: bytes, end_stream: bool = False) -> DataFrame:
        frame = DataFrame(stream_id, payload)
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame

    @staticmethod
    def window_update(stream_id: int, increment: int) -> WindowUpdateFrame:
        return WindowUpdateFrame(stream_id, window_increment=increment)

    @staticmethod
    def continuation(stream_id: int, block: bytes, end: bool) -> ContinuationFrame:
        frame = ContinuationFrame(stream_id, block)
        if end:
            frame.flags.add("END_HEADERS")
        return frame

    def send(self, *frames: Frame) -> bool:
        """Write ``frames`` in one go; False once the server has closed."""
        try:
            self.sock.sendall(b"".join(frame.serialize() for frame in frames))
        except OSError:
            self._closed()
            return False
        return True

    def read(self, wait_s: float = 0.0) -> ServerSaid:
        """Read what has arrived, waiting up to ``wait_s`` for the first bytes."""
        self.sock.settimeout(max(wait_s, 0.001))
        while not self.said.closed_at:
            try:
                chunk = self.sock.recv(65536)
            except (TimeoutError, ssl.SSLWantReadError, BlockingIOError):
                break
            except OSError:
                self._closed()
                break
            if not chunk:
                self._closed()
                break
            self._buffer += chunk
            self._parse()
            self.sock.settimeout(0.001)
        return self.said

    def wait_closed(self, timeout_s: float) -> ServerSaid:
        deadline = time.monotonic() + timeout_s
        while not self.said.closed_at and time.monotonic() < deadline:
            self.read(0.05)
        return self.said

    def close(self) -> None:
        self.sock.close()

    def _closed(self) -> None:
        if not self.said.closed_at:
            self.said.closed_at = time.monotonic()

    def _parse(self) -> None:
        while len(self._buffer) >= FRAME_HEADER:
            frame, length = Frame.parse_frame_header(memoryview(self._buffer[:FRAME_HEADER]))
            if len(self._buffer) < FRAME_HEADER + length:
                return
            frame.parse_body(memoryview(self._buffer[FRAME_HEADER:FRAME_HEADER + length]))
            del self._buffer[:FRAME_HEADER + length]
            self._seen(frame)

    def _seen(self, frame: Frame) -> None:
        kind = type(frame).__name__
        self.said.frames[kind] = self.said.frames.get(kind, 0) + 1
        if isinstance(frame, GoAwayFrame) and self.said.goaway_code is None:
            self.said.goaway_code = frame.error_code
            self.said.goaway_last_stream = frame.last_stream_id
            self.said.goaway_at = time.monotonic()
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            ack = SettingsFrame(0)
            ack.flags.add("ACK")
            self.send(ack)
        elif isinstance(frame, RstStreamFrame):
            self.said.reset_streams[frame.stream_id] = frame.error_code
        elif isinstance(frame, DataFrame):
            self.said.data.setdefault(frame.stream_id, bytearray()).extend(frame.data)
            if self.auto_window and frame.flow_controlled_length:
                self.send(self.window_update(0, frame.flow_controlled_length))
        if "END_STREAM" in frame.flags and frame.stream_id:
            self.said.ended_streams.add(frame.stream_id)
