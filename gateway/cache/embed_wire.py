"""The embedding sidecar's wire format: length-prefixed frames on a Unix socket.

    request   <Q request id><I text length>  UTF-8 text (at most MAX_TEXT_CHARS)
    response  <Q request id><B status><H batch size><I payload length>  payload
              status OK: the unit vector as little-endian float32 (dim * 4 bytes)
              status FAILED: a UTF-8 reason (the model failed on this batch)

Requests carry an id so that one connection multiplexes concurrent embeds and
answers may come back in any order. A response says how many texts its batch
held, so the client can see how well load is batched. Sizes are bounded on both sides: a frame
over its bound is a protocol error and closes the connection.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from anyio.streams.buffered import BufferedByteReceiveStream

from gateway.cache.embedder import MAX_TEXT_CHARS

REQUEST_HEAD = struct.Struct("<QI")
RESPONSE_HEAD = struct.Struct("<QBHI")
OK = 0
FAILED = 1
MAX_TEXT_BYTES = 4 * MAX_TEXT_CHARS  # UTF-8 is at most 4 bytes a character
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
    text: str


@dataclass(frozen=True)
class EmbedResponse:
    request_id: int
    vector: np.ndarray | None  # None: the model failed, see ``error``
    batch: int = 1  # how many texts the model encoded together with this one
    error: str = ""


def request_frame(request_id: int, text: str) -> bytes:
    data = text[:MAX_TEXT_CHARS].encode("utf-8", errors="replace")
    return REQUEST_HEAD.pack(request_id, len(data)) + data


def vector_frame(request_id: int, vector: np.ndarray, batch: int) -> bytes:
    data = np.ascontiguousarray(vector, dtype="<f4").tobytes()
    return RESPONSE_HEAD.pack(request_id, OK, min(batch, 0xFFFF), len(data)) + data


def failure_frame(request_id: int, reason: str) -> bytes:
    data = reason.encode("utf-8", errors="replace")[:1024]
    return RESPONSE_HEAD.pack(request_id, FAILED, 0, len(data)) + data


async def read_request(stream: BufferedByteReceiveStream) -> EmbedRequest:
    """The next request; raises anyio.EndOfStream/IncompleteRead at the end."""
    request_id, length = REQUEST_HEAD.unpack(await stream.receive_exactly(REQUEST_HEAD.size))
    if length > MAX_TEXT_BYTES:
        raise ProtocolError(f"request text of {length} bytes (at most {MAX_TEXT_BYTES})")
    text = (await stream.receive_exactly(length)).decode("utf-8", errors="replace")
    return EmbedRequest(request_id, text)


async def read_response(stream: BufferedByteReceiveStream, dim: int) -> EmbedResponse:
    """The next response; raises anyio.EndOfStream/IncompleteRead at the end."""
    head = await stream.receive_exactly(RESPONSE_HEAD.size)
    request_id, status, batch, length = RESPONSE_HEAD.unpack(head)
    if length > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"response payload of {length} bytes")
    payload = await stream.receive_exactly(length)
    if status == FAILED:
        return EmbedResponse(request_id, None, 0, payload.decode("utf-8", errors="replace"))
    if status != OK or length != dim * 4:
        raise ProtocolError(f"response status {status} with {length} bytes (dim {dim})")
    return EmbedResponse(request_id, np.frombuffer(payload, dtype="<f4").astype(np.float32), batch)
