"""HTTP/2: DATA for a stream whose response already ended must not kill the
connection, and a stream refused during shutdown says so (REFUSED_STREAM).

Hypercorn 0.18 looks the stream up with ``self.streams[stream_id]`` for every
DATA frame (``hypercorn/protocol/h2.py``, ``_handle_events``). When the app
answers before reading the whole body — a 413 for a body over
``limits.max_body_bytes``, a 401 before the body is read — hypercorn forgets
the stream, the client's remaining DATA raises ``KeyError``, and the whole
connection dies with an unhandled-exception traceback: the client never sees
its 413, and every other stream on that connection is cut
(pgjones/hypercorn#329; fixes proposed in #312, #334, #365, none released).

``install_h2_guard`` wraps ``_handle_events``: DATA for a stream hypercorn no
longer tracks is dropped, its bytes still credited to the connection's flow
control window (so the connection never stalls); the client gets its 413 and
the connection and its other streams live on. The stream is not reset: a
RST_STREAM (NO_ERROR) sent there broke the connection for curl ("Error in the
HTTP2 framing layer"), so the rest of the body is read and discarded (no
memory kept; the bandwidth is spent). httpx 0.28 cannot read a response that
arrives before its HTTP/2 upload ends and reports "Server disconnected":
a client limitation, seen with or without this guard. In one of six manual
curl runs that reused the connection right after such a 413, the server
answered the next stream with GOAWAY (PROTOCOL_ERROR); not pursued.

During shutdown hypercorn resets every new stream on a connection already
open with RST_STREAM (NO_ERROR), which promises nothing, so clients report a
failure. The guard refuses such a stream with REFUSED_STREAM instead (RFC
9113, 8.7: not processed, safe to retry), and advertises no more streams.
"""

from __future__ import annotations

from typing import Any

import h2.events
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hypercorn.protocol.h2 import H2Protocol

_ORIGINAL = "_hedgerow_unguarded_handle_events"


def install_h2_guard() -> None:
    """Patch ``H2Protocol._handle_events`` in place; idempotent."""
    if hasattr(H2Protocol, _ORIGINAL):
        return
    original = H2Protocol._handle_events
    setattr(H2Protocol, _ORIGINAL, original)

    async def handle_events(self: H2Protocol, events: list[h2.events.Event]) -> None:
        # One at a time: a stream exists only once the RequestReceived before
        # its DATA in the same batch has been handled.
        for event in events:
            if _refused_while_draining(self, event):
                await original(self, [])  # flushes the RST_STREAM
            elif not _late_data(self, event):
                await original(self, [event])

    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]


def _refused_while_draining(protocol: Any, event: h2.events.Event) -> bool:
    """A new stream on a connection of a server that is shutting down: refuse it
    with REFUSED_STREAM, which tells the client that nothing was processed and a
    retry elsewhere is safe (RFC 9113, 8.7). Hypercorn resets it with NO_ERROR,
    which promises nothing, and clients report a failure."""
    if not isinstance(event, h2.events.RequestReceived) or not protocol.context.terminated.is_set():
        return False
    connection = protocol.connection
    connection.reset_stream(event.stream_id, error_code=ErrorCodes.REFUSED_STREAM)
    connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 0})
    return True


def _late_data(protocol: Any, event: h2.events.Event) -> bool:
    """Whether ``event`` is DATA for a forgotten stream (and, if so, settle it)."""
    if not isinstance(event, h2.events.DataReceived) or event.stream_id in protocol.streams:
        return False
    connection = protocol.connection
    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    return True
