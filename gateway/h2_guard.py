"""HTTP/2: DATA for a stream whose response already ended must not kill the connection.

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
"""

from __future__ import annotations

from typing import Any

import h2.events
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
            if not _late_data(self, event):
                await original(self, [event])

    H2Protocol._handle_events = handle_events  # type: ignore[method-assign]


def _late_data(protocol: Any, event: h2.events.Event) -> bool:
    """Whether ``event`` is DATA for a forgotten stream (and, if so, settle it)."""
    if not isinstance(event, h2.events.DataReceived) or event.stream_id in protocol.streams:
        return False
    connection = protocol.connection
    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    return True
