"""HTTP/1.1 response framing, sans-IO: the parsing half of ``gateway.upstream.worker_http``.

Nothing here touches a socket. ``parse_head`` takes the buffered bytes of a
response and returns its status line and headers once they are complete;
``body_framing`` says how the body that follows is delimited (RFC 9112 §6.3);
the body decoders take the connection's receive buffer, consume what they can
use, and return the payload bytes. Limits are enforced here so a misbehaving
upstream cannot grow a buffer without bound; time bounds are the pool's
(``gateway.upstream.worker_http``: a read-idle limit per read, the attempt's TTFT
deadline over the head; h11, being sans-IO too, has none of its own).

Strictness: whatever h11 (0.16) refuses in a reply, this refuses too, and
where both accept they read it alike (``tests/unit/test_http1_vs_h11.py``,
hypothesis, differential). It is deliberately stricter where a worker has no
business sending what h11 tolerates:

* line ends are CRLF only: h11 also ends lines at a bare LF; here a bare CR or
  LF inside a head is a control character, refused;
* obs-fold (a line starting with SP/HTAB) is refused, as RFC 9112 §5.2 allows
  a gateway to do; h11 unfolds it;
* no control character but HTAB in a reason phrase or field value (RFC 9110
  §5.5); h11 refuses only NUL, CR, LF, VT, FF;
* the version is HTTP/1.0 or HTTP/1.1 (h11 takes any ``HTTP/d.d``);
* framing: ``transfer-encoding`` with ``content-length``, or in an HTTP/1.0
  reply, is refused (h11 lets transfer-encoding win). As with h11, the only
  transfer-coding is a single ``chunked``: ``gzip``, ``gzip, chunked`` or two
  ``chunked`` headers are refused, and framing headers are checked on 1xx, 204
  and 304 replies too; content-length copies must be identical as text;
* sizes: head 16 KiB (h11's default) even when it arrives in one read (h11
  checks only a head still incomplete); content-length 18 digits (h11: 20);
  chunk size 16 hex digits (h11: 20); a chunk-size line 1 KiB; trailers
  16 KiB in all, however they are cut (h11: 16 KiB of any unfinished event);
* ``connection`` containing "close" anywhere ends reuse (h11 parses the list):
  in doubt, a connection is not reused.

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

import re
from dataclasses import dataclass

from hedgerow.decimal_text import parse_decimal

MAX_HEAD_BYTES = 16 * 1024  # status line + headers of one response (h11's default)
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
    chunked: bool = False  # ``transfer-encoding: chunked`` (the only coding accepted)
    content_length: int | None = None


# The grammar of RFC 9112 §4 and RFC 9110 §5.5/§5.6.2, as h11 reads it but with
# no control characters but HTAB in a reason or value. Each pattern is linear:
# no two adjacent repetitions can trade characters, so no input backtracks.
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: [\t\x20-\x7e\x80-\xff]*)?")
_FIELD_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+):([\t\x20-\x7e\x80-\xff]*)")


def parse_head(buffer: bytearray) -> ResponseHead | None:
    """The head at the start of ``buffer`` (consumed from it), or None until it is complete."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
        first = buffer.find(b"\n")
        if first == 0 or first > 0 and buffer[first - 1] != 0x0D:
            # A peer that ends lines with bare LF would never end its head here:
            # say so now rather than wait for the head limit or a timeout.
            raise ProtocolError("a bare LF ends the status line")
        return None
    if end > MAX_HEAD_BYTES:
        raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
    lines = bytes(buffer[:end]).split(b"\r\n")
    del buffer[:end + 4]
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(status_line[2])
    if status == 101:  # this client never asks to switch protocols
        raise ProtocolError("101 switching protocols without an upgrade request")
    http11 = status_line[1] == b"1"
    headers = _header_fields(lines[1:])
    chunked = _chunked(headers, http11)
    length = headers.get("content-length")
    content_length = None if length is None else _content_length(length)
    keep_alive = http11 and "close" not in headers.get("connection", "").lower()
    return ResponseHead(status, headers, keep_alive, chunked, content_length)


def _header_fields(lines: list[bytes]) -> dict[str, str]:
    headers: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}  # joined once at the end: linear however many repeats
    for line in lines:
        name, text = _field(line)
        if name not in headers:
            headers[name] = text
        elif name in repeated:
            repeated[name].append(text)
        else:
            repeated[name] = [headers[name], text]
    for name, texts in repeated.items():
        headers[name] = ", ".join(texts)
    return headers


def _field(line: bytes) -> tuple[str, str]:
    """A field line's lowercased name and its value without optional whitespace.

    A space before the colon, an obs-fold continuation, a name that is not a
    token, a control character in the value (CR, LF and NUL included): refused.
    """
    field = _FIELD_LINE.fullmatch(line)
    if field is None:
        raise ProtocolError(f"malformed header line: {line[:80]!r}")
    # Only SP and HTAB are optional whitespace (RFC 9110 §5.6.3): bytes.strip()
    # would also eat VT and FF, and str.strip() the NBSP and NEL of latin-1.
    return field[1].decode("ascii").lower(), field[2].strip(b" \t").decode("latin-1")


def _chunked(headers: dict[str, str], http11: bool) -> bool:
    """Whether the body is chunked; refuses every transfer-encoding but one ``chunked``."""
    encoding = headers.get("transfer-encoding")
    if encoding is None:
        return False
    if not http11:
        # RFC 9112 §6.1: HTTP/1.0 has no transfer codings; such framing is faulty.
        raise ProtocolError("transfer-encoding in an HTTP/1.0 response")
    if "content-length" in headers:
        # RFC 9112 §6.3: "ought to be handled as an error" -- the two framings
        # disagree about where this response ends, and so where the next begins.
        raise ProtocolError("both transfer-encoding and content-length")
    if encoding.lower() != "chunked":
        # Nothing here decodes gzip or any other coding, and "chunked, chunked"
        # (two headers) is a smuggling probe: refuse rather than pass coded bytes on.
        raise ProtocolError(f"unsupported transfer-encoding: {encoding[:40]!r}")
    return True


def body_framing(head: ResponseHead) -> ChunkedBody | LengthBody | CloseDelimitedBody:
    """How the body after ``head`` ends; a close-delimited body ends its connection too."""
    if 100 <= head.status < 200 or head.status in (204, 304):
        return LengthBody(0)
    if head.chunked:
        return ChunkedBody()
    if head.content_length is None:
        return CloseDelimitedBody()
    return LengthBody(head.content_length)


def _content_length(header: str) -> int:
    """One length, however often repeated (RFC 9112 §6.3 allows identical copies).

    Copies must be identical as text ("011" and "11" are not), as h11 has it.
    """
    texts = {v.strip(" \t") for v in header.split(",")}
    if len(texts) != 1 or (value := parse_decimal(texts.pop())) is None:
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
_CRLF = b"\r\n"


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
            if self._phase == _DATA_END:
                # The CRLF after the data, checked as soon as its bytes arrive:
                # anything else means the data was longer than its size said.
                ending = buffer[pos:pos + 2]
                if ending == _CRLF:
                    pos += 2
                    self._phase = _SIZE
                    continue
                if not _CRLF.startswith(ending):
                    raise ProtocolError("chunk data longer than its declared size")
                break
            end = buffer.find(_CRLF, pos)
            if end < 0:
                self._check_partial_line(len(buffer) - pos)
                break
            if self._phase == _TRAILER:
                self._line(bytes(buffer[pos:end]))
                pos = end + 2
                continue
            if end - pos > MAX_CHUNK_LINE_BYTES:  # a line that arrived whole is bounded too
                raise ProtocolError("chunk-size line too long")
            size = _chunk_size(bytes(buffer[pos:end]))
            pos = end + 2
            stop = pos + size
            if size and stop + 2 <= len(buffer):
                # The whole chunk and the CRLF after it are here (a worker's token
                # event in one read): taken in one step, its CRLF checked as when it
                # comes in a later read.
                if buffer[stop:stop + 2] != _CRLF:
                    raise ProtocolError("chunk data longer than its declared size")
                pieces.append(buffer[pos:stop])
                pos = stop + 2
            else:
                self._remaining = size
                self._phase = _DATA if size else _TRAILER
        del buffer[:pos]
        return b"".join(pieces)

    def _line(self, line: bytes) -> None:
        """A trailer line, or the empty line that ends the body."""
        if not line:
            self.done = True
        else:
            self._trailer_bytes += len(line) + 2
            self._check_partial_line(0)
            _field(line)  # the same rules as a header line (RFC 9112 §7.1.2)

    def _check_partial_line(self, pending: int) -> None:
        if self._phase == _TRAILER:
            if self._trailer_bytes + pending > MAX_TRAILER_BYTES:
                raise ProtocolError("chunked trailer too large")
        elif pending > MAX_CHUNK_LINE_BYTES:
            raise ProtocolError("chunk-size line too long")

    def at_eof(self) -> None:
        if not self.done:
            raise ConnectionBroken("connection closed in the middle of a chunked body")


# 1 to 16 hex digits (h11 takes 20: more than 2**64 bytes is no real chunk), then
# trailing whitespace or extensions; ";" directly after the size, as h11 wants it.
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:[ \t]*|;[\t\x20-\x7e\x80-\xff]*)")


def _chunk_size(line: bytes) -> int:
    size = _CHUNK_SIZE_LINE.fullmatch(line)
    if size is None:
        raise ProtocolError(f"bad chunk size line: {line[:40]!r}")
    return int(size[1], 16)
