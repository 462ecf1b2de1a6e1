"""The embedding sidecar's wire format: length-prefixed frames on a Unix socket.

    request   <Q request id><B op><I payload length>  payload
              op EMBED: one UTF-8 text (at most MAX_TEXT_CHARS)
              op JUDGE: the new question, then each cached question to judge it
                        against (1 to MAX_CANDIDATES), each text <I length> + UTF-8
    response  <Q request id><B status><H batch size><I payload length>  payload
              status OK, EMBED: the unit vector as little-endian float32 (dim * 4 bytes)
              status OK, JUDGE: one little-endian float32 score per cached question
              status FAILED: a UTF-8 reason (the model failed on this batch, or
                             the sidecar has no pair model to judge with)

Requests carry an id so that one connection multiplexes concurrent requests
and answers may come back in any order; the asker knows what it asked, so a
response's payload is checked against that (``floats_of``). A
response says how many requests its batch held, so the client can see how well
load is batched. Sizes are bounded on both sides: a frame over its bound is a
protocol error and closes the connection.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from anyio.streams.buffered import BufferedByteReceiveStream

from gateway.cache.embedder import MAX_TEXT_CHARS
from gateway.cache.pair_model import MAX_CANDIDATES

REQUEST_HEAD = struct.Struct("<QBI")
RESPONSE_HEAD = struct.Struct("<QBHI")
TEXT_HEAD = struct.Struct("<I")
EMBED = 0
JUDGE = 1
OK = 0
FAILED = 1
MAX_TEXT_BYTES = 4 * MAX_TEXT_CHARS  # UTF-8 is at most 4 bytes a character
MAX_JUDGE_BYTES = (1 + MAX_CANDIDATES) * (TEXT_HEAD.size + MAX_TEXT_BYTES)
MAX_PAYLOAD_BYTES = 64 * 1024
READY_LINE = b"ready"  # the server's only line on stdout: b"ready <dim>\n"
NO_MODEL_LINE = b"no-model"  # ... or, before it exits with EXIT_NO_MODEL, b"no-model <why>\n"
MAX_LINE_BYTES = 1024
EXIT_NO_MODEL = 3  # the server's exit status when the model cannot load: restarts won't help


class ProtocolError(Exception):
    """A frame that breaks the format: the connection is closed."""


@dataclass(frozen=True)
class EmbedRequest:
    request_id: int
    op: int
    texts: tuple[str, ...]  # EMBED: (text,); JUDGE: (new question, *cached questions)


@dataclass(frozen=True)
class EmbedResponse:
    request_id: int
    ok: bool
    batch: int  # how many requests the sidecar served together with this one
    payload: bytes  # OK: the float32s; FAILED: the reason


def _utf8(text: str) -> bytes:
    return text[:MAX_TEXT_CHARS].encode("utf-8", errors="replace")


def request_frame(request_id: int, text: str) -> bytes:
    data = _utf8(text)
    return REQUEST_HEAD.pack(request_id, EMBED, len(data)) + data


def judge_frame(request_id: int, question: str, cached: Sequence[str]) -> bytes:
    if not 1 <= len(cached) <= MAX_CANDIDATES:
        raise ValueError(f"judge 1 to {MAX_CANDIDATES} cached questions, not {len(cached)}")
    data = b"".join(TEXT_HEAD.pack(len(encoded)) + encoded
                    for encoded in map(_utf8, (question, *cached)))
    return REQUEST_HEAD.pack(request_id, JUDGE, len(data)) + data


def floats_frame(request_id: int, values: np.ndarray, batch: int) -> bytes:
    data = np.ascontiguousarray(values, dtype="<f4").tobytes()
    return RESPONSE_HEAD.pack(request_id, OK, min(batch, 0xFFFF), len(data)) + data


def failure_frame(request_id: int, reason: str) -> bytes:
    data = reason.encode("utf-8", errors="replace")[:1024]
    return RESPONSE_HEAD.pack(request_id, FAILED, 0, len(data)) + data


async def read_request(stream: BufferedByteReceiveStream) -> EmbedRequest:
    """The next request; raises anyio.EndOfStream/IncompleteRead at the end."""
    request_id, op, length = REQUEST_HEAD.unpack(await stream.receive_exactly(REQUEST_HEAD.size))
    if op == EMBED and length <= MAX_TEXT_BYTES:
        text = (await stream.receive_exactly(length)).decode("utf-8", errors="replace")
        return EmbedRequest(request_id, op, (text,))
    if op == JUDGE and length <= MAX_JUDGE_BYTES:
        return EmbedRequest(request_id, op, _texts(await stream.receive_exactly(length)))
    raise ProtocolError(f"request op {op} with {length} bytes")


def _texts(data: bytes) -> tuple[str, ...]:
    texts, at = [], 0
    while at < len(data):
        if len(data) - at < TEXT_HEAD.size:
            raise ProtocolError("a judge request's text is cut short")
        (length,) = TEXT_HEAD.unpack_from(data, at)
        at += TEXT_HEAD.size
        if length > MAX_TEXT_BYTES or at + length > len(data):
            raise ProtocolError(f"a judge request's text of {length} bytes")
        texts.append(data[at:at + length].decode("utf-8", errors="replace"))
        at += length
    if not 2 <= len(texts) <= 1 + MAX_CANDIDATES:
        raise ProtocolError(f"a judge request of {len(texts)} texts")
    return tuple(texts)


async def read_response(stream: BufferedByteReceiveStream) -> EmbedResponse:
    """The next response; raises anyio.EndOfStream/IncompleteRead at the end."""
    head = await stream.receive_exactly(RESPONSE_HEAD.size)
    request_id, status, batch, length = RESPONSE_HEAD.unpack(head)
    if length > MAX_PAYLOAD_BYTES or status not in (OK, FAILED):
        raise ProtocolError(f"response status {status} with {length} bytes")
    return EmbedResponse(request_id, status == OK, batch, await stream.receive_exactly(length))


def floats_of(response: EmbedResponse, count: int) -> np.ndarray:
    """An OK response's ``count`` float32s (a vector, or scores)."""
    if len(response.payload) != count * 4:
        raise ProtocolError(f"{len(response.payload)} bytes where {count} float32s were due")
    return np.frombuffer(response.payload, dtype="<f4").astype(np.float32)
