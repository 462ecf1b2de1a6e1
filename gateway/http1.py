"""HTTP/1.1 response framing, sans-IO: the parsing half of ``gateway.worker_http``.

Nothing here touches a socket. ``parse_head`` takes the buffered bytes of a
response and returns its status line and headers once they are complete;
``body_framing`` says how the body that follows is delimited (RFC 9112 §6.3);
the body decoders take the connection's receive buffer, consume what they can
use, and return the payload bytes. Limits are enforced here so a misbehaving
upstream cannot grow a buffer without bound.

The client's exception tree lives here too, so the parser, the pool and the
in-memory twin raise the same errors::

    HttpError
    ├── HttpTimeout         (upstream_timeout)
    │   ├── ConnectTimeout
    │   ├── ReadTimeout     no byte for the idle limit
    │   ├── WriteTimeout
    │   └── PoolTimeout     no free connection to the origin in time
    ├── ConnectFailed       refused, unresolvable, TLS handshake failed
    ├── ConnectionBroken    closed or reset before the response was complete
    └── ProtocolError       not a response this client accepts (e.g. oversized head)
"""

from __future__ import annotations

from dataclasses import dataclass

from hedgerow.decimal_text import parse_decimal

MAX_HEAD_BYTES = 64 * 1024  # status line + headers of one response
MAX_CHUNK_LINE_BYTES = 1024  # a chunk-size line, extensions included
MAX_TRAILER_BYTES = 16 * 1024


class HttpError(Exception):
    """Root of the worker HTTP client's errors."""


class HttpTimeout(HttpError):
    pass


class ConnectTimeout(HttpTimeout):
    pass


class ReadTimeout(HttpTimeout):
    pass


class WriteTimeout(HttpTimeout):
    pass


class PoolTimeout(HttpTimeout):
    pass


class ConnectFailed(HttpError):
    pass


class ConnectionBroken(HttpError):
    pass


class ProtocolError(HttpError):
    """The peer's bytes are not a response this client accepts."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: dict[str, str]  # names lowercased; repeated headers joined with ", "
    keep_alive: bool  # HTTP/1.1 without ``connection: close``


def parse_head(buffer: bytearray) -> ResponseHead | None:
    """The head at the start of ``buffer`` (consumed from it), or None until it is complete."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
        return None
    if end > MAX_HEAD_BYTES:
        raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
    lines = bytes(buffer[:end]).split(b"\r\n")
    del buffer[:end + 4]
    version, status = _status_line(lines[0])
    headers = _header_fields(lines[1:])
    if version == b"HTTP/1.0" and "transfer-encoding" in headers:
        # RFC 9112 §6.1: HTTP/1.0 has no transfer codings; such framing is faulty.
        raise ProtocolError("transfer-encoding in an HTTP/1.0 response")
    connection = headers.get("connection", "").lower()
    keep_alive = version == b"HTTP/1.1" and "close" not in connection
    return ResponseHead(status, headers, keep_alive)


def _status_line(line: bytes) -> tuple[bytes, int]:
    parts = line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise ProtocolError(f"not an HTTP/1.x status line: {line[:80]!r}")
    code = parts[1]
    if len(code) != 3 or not code.isdigit():
        raise ProtocolError(f"bad status code: {code[:16]!r}")
    return parts[0], int(code)


def _header_fields(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or name[:1] in b" \t":
            raise ProtocolError(f"malformed header line: {line[:80]!r}")
        key = name.decode("latin-1").lower()
        # Only SP and HTAB are optional whitespace (RFC 9110 §5.6.3): str.strip()
        # would also eat the NBSP and NEL that latin-1 decodes from 0xa0 and 0x85.
        text = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


def body_framing(head: ResponseHead) -> ChunkedBody | LengthBody | CloseDelimitedBody:
    """How the body after ``head`` ends; a close-delimited body ends its connection too."""
    if 100 <= head.status < 200 or head.status in (204, 304):
        return LengthBody(0)
    encoding = head.headers.get("transfer-encoding")
    length = head.headers.get("content-length")
    if encoding is not None:
        if length is not None:
            # RFC 9112 §6.3: "ought to be handled as an error" -- the two framings
            # disagree about where this response ends, and so where the next begins.
            raise ProtocolError("both transfer-encoding and content-length")
        if encoding.lower().rsplit(",", 1)[-1].strip(" \t") != "chunked":
            return CloseDelimitedBody()
        return ChunkedBody()
    if length is None:
        return CloseDelimitedBody()
    return LengthBody(_content_length(length))


def _content_length(header: str) -> int:
    """One length, however often repeated (RFC 9112 §6.3 allows identical copies)."""
    values = {parse_decimal(v.strip(" \t")) for v in header.split(",")}
    if len(values) != 1 or (value := values.pop()) is None:
        raise ProtocolError(f"bad content-length: {header[:40]!r}")
    return value


class LengthBody:
    """A body of ``content-length`` bytes."""

    reusable = True  # the connection may serve another request afterwards

    def __init__(self, length: int) -> None:
        self.remaining = length
        self.done = length == 0

    def decode(self, buffer: bytearray) -> bytes:
        take = min(len(buffer), self.remaining)
        if take == len(buffer):
            data = bytes(buffer)
            buffer.clear()
        else:
            data = bytes(buffer[:take])
            del buffer[:take]
        self.remaining -= take
        self.done = self.remaining == 0
        return data

    def at_eof(self) -> None:
        if not self.done:
            raise ConnectionBroken(f"connection closed with {self.remaining} body bytes missing")


class CloseDelimitedBody:
    """A body that ends when the peer closes the connection."""

    reusable = False

    def __init__(self) -> None:
        self.done = False

    def decode(self, buffer: bytearray) -> bytes:
        data = bytes(buffer)
        buffer.clear()
        return data

    def at_eof(self) -> None:
        self.done = True


_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class ChunkedBody:
    """``transfer-encoding: chunked``; chunk boundaries may fall anywhere in a read."""

    reusable = True

    def __init__(self) -> None:
        self.done = False
        self._phase = _SIZE
        self._remaining = 0  # of the current chunk's data
        self._trailer_bytes = 0

    def decode(self, buffer: bytearray) -> bytes:
        pieces: list[bytes | bytearray] = []
        pos = 0
        while not self.done:
            if self._phase == _DATA:
                take = min(self._remaining, len(buffer) - pos)
                if take == 0:
                    break
                pieces.append(buffer[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._phase = _DATA_END
                continue
            end = buffer.find(b"\r\n", pos)
            if end < 0:
                self._check_partial_line(len(buffer) - pos)
                break
            self._line(bytes(buffer[pos:end]))
            pos = end + 2
        del buffer[:pos]
        return b"".join(pieces)

    def _line(self, line: bytes) -> None:
        if self._phase == _SIZE:
            self._remaining = _chunk_size(line)
            self._phase = _DATA if self._remaining else _TRAILER
        elif self._phase == _DATA_END:
            if line:
                raise ProtocolError("chunk data longer than its declared size")
            self._phase = _SIZE
        elif not line:
            self.done = True
        else:
            self._trailer_bytes += len(line) + 2
            if self._trailer_bytes > MAX_TRAILER_BYTES:
                raise ProtocolError("chunked trailer too large")

    def _check_partial_line(self, pending: int) -> None:
        limit = MAX_TRAILER_BYTES if self._phase == _TRAILER else MAX_CHUNK_LINE_BYTES
        if pending > limit:
            raise ProtocolError("chunk-size line too long")

    def at_eof(self) -> None:
        if not self.done:
            raise ConnectionBroken("connection closed in the middle of a chunked body")


_HEX = frozenset(b"0123456789abcdefABCDEF")


def _chunk_size(line: bytes) -> int:
    size = line.split(b";", 1)[0].strip()
    if not size or len(size) > 16 or not _HEX.issuperset(size):
        raise ProtocolError(f"bad chunk size line: {line[:40]!r}")
    return int(size, 16)
