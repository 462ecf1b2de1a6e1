"""Where the gateway's QUIC front door plugs into hypercorn's QUIC and HTTP/3.

Changes (hypercorn 0.18.0, aioquic 1.7.2), with behaviour supplied by
``gateway.edge.quic_cap``:

- ``QuicProtocol.handle`` wrapped: an Initial for an unknown connection goes
  through the front door (Retry, per-client limits, the connection cap, a
  handshake timer) and admitted connections are built by the door with the
  ids aioquic needs after a Retry; every other packet goes to hypercorn.
- ``QuicProtocol._handle_events`` wrapped: each connection's handshake done
  and its end (hypercorn forgets its ids) are reported to the door.
- ``H3Protocol.handle`` replaced by ``gateway.edge.quic_cap.guarded_h3_handle``:
  hypercorn's lines, with late DATA dropped, trailers ending the body and a
  bounded wait for a body chunk (hypercorn handles every HTTP/3 connection of
  a process in one task, and DATA after the response ended raised
  ``KeyError`` there, ending HTTP/3 for all of them: pgjones/hypercorn#329's
  HTTP/3 twin; upstream: ``docs/upstream/h3-late-data-and-trailers.patch``).
- ``H3Protocol.stream_send`` wrapped: what an application still sends for a
  request whose client left (``quic_cap._client_left``) is dropped.
- ``hypercorn.protocol.h3.H3Connection`` (the name ``H3Protocol`` builds
  from) replaced by ``gateway.edge.quic_cap.BoundedH3Connection``, aioquic's
  ``H3Connection`` with field-section and QPACK bounds; it overrides five of
  aioquic's private methods, all checked here.

Why: hypercorn builds a connection (and starts a TLS handshake) for every
Initial without limit, never sends a Retry, and lets a half-open connection
sit for 60 s; aioquic buffers a HEADERS frame of any declared size.

If the internals moved: ``PatchError`` at install naming what is missing
(the methods wrapped or overridden, ``hypercorn.protocol.quic._Connection``
and the module names swapped); wrappers pass ``*args, **kwargs`` through.
``tests/unit/test_http_stack_quic_front_door.py`` shows a Retry from a real
listener, and ``tests/unit/test_quic_cap_patches.py`` the HTTP/3 bounds.

Scope: listener for the door (``ACTIVE_QUIC_DOOR``, set by the gateway's
``serve``: no door, hypercorn's ``handle`` unchanged); process for
``guarded_h3_handle`` and ``BoundedH3Connection`` (default limits where no
door is in force).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypercorn.protocol.h3
import hypercorn.protocol.quic
from aioquic.h3.connection import H3Connection
from hypercorn.protocol.h3 import H3Protocol
from hypercorn.protocol.quic import QuicProtocol

from hedgerow.http_stack.patch import replace, require, wrap

NAME = "quic_front_door"

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def install(*, make_handle: Wrapper, make_handle_events: Wrapper,
            h3_handle: Callable[..., Any], h3_connection: type[H3Connection],
            make_stream_send: Wrapper) -> None:
    """Idempotent: the first call's behaviour stays."""
    require(QuicProtocol, "handle", "_handle_events", "send_all", patch=NAME)
    require(hypercorn.protocol.quic, "_Connection", "QuicConnection", patch=NAME)
    require(H3Protocol, "handle", "_create_stream", "stream_send", patch=NAME)
    require(H3Connection, "_init_connection", "_get_local_settings",
            "_check_request_or_push_frame_type", "_decode_headers",
            "_receive_request_or_push_data", patch=NAME)
    wrap(QuicProtocol, "handle", make_handle, patch=NAME)
    wrap(QuicProtocol, "_handle_events", make_handle_events, patch=NAME)
    replace(H3Protocol, "handle", h3_handle, patch=NAME)
    wrap(H3Protocol, "stream_send", make_stream_send, patch=NAME)
    replace(hypercorn.protocol.h3, "H3Connection", h3_connection, patch=NAME)
