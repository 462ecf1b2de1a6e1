"""hypercorn's QUIC connections: bounded flow control, and session tickets.

Changes: ``hypercorn.protocol.quic.QuicConnection`` (the name hypercorn
0.18.0's ``QuicProtocol.handle`` builds each server connection from) becomes
a ``functools.partial`` of ``BoundedQuicConnection`` with the two session
ticket callbacks given to ``install``. ``BoundedQuicConnection`` is aioquic
1.7.2's ``QuicConnection`` with its two private limit writers
(``_write_connection_limits``, ``_write_stream_limits``) re-stated with one
rule changed.

Why: (1) hypercorn builds ``QuicConnection(configuration=...,
original_destination_connection_id=...)`` without aioquic's
``session_ticket_handler`` (without which the server issues no ticket) or
``session_ticket_fetcher`` (without which it accepts none): no HTTP/3 client
could ever resume (upstream: ``docs/upstream/quic-session-tickets.patch``).
(2) aioquic doubles a receive limit once the peer has *sent* half of it,
delivered or not, so a client could double what the gateway allocates every
round trip (see ``BoundedQuicConnection``).

If the internals moved: ``PatchError`` at install when
``hypercorn.protocol.quic`` has no ``QuicConnection`` name, or aioquic's
``QuicConnection`` lacks the methods re-stated here or the delivery handlers
they register; the partial passes every argument hypercorn gives through, so
a new keyword reaches aioquic. ``tests/unit/test_http_stack_quic_connection.py``
shows both effects on the pinned aioquic.

Scope: process (every QUIC connection; the ticket store is the process's).
"""

from __future__ import annotations

import functools
from typing import Any

import hypercorn.protocol.quic
from aioquic.quic.connection import (
    CONNECTION_LIMIT_FRAME_CAPACITY,
    MAX_STREAM_DATA_FRAME_CAPACITY,
    QuicConnection,
)
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream
from aioquic.tls import SessionTicketFetcher, SessionTicketHandler

from hedgerow.http_stack.patch import replace, require

NAME = "quic_connection"


class BoundedQuicConnection(QuicConnection):
    """aioquic's ``QuicConnection`` with bounded flow-control windows.

    aioquic 1.7.2 doubles a stream's MAX_STREAM_DATA as soon as the peer has
    *sent* past half of it, and the connection's MAX_DATA likewise, whatever
    was delivered; and a STREAM frame past a gap makes the receiver allocate
    the gap (``QuicStreamReceiver.handle_frame``). So a client sending one
    byte just under each new limit doubled what it could make the gateway
    allocate every round trip: from 256 KiB past 1 GiB in a dozen.

    Here each limit is what was delivered in order plus the configured window
    (``configuration.max_stream_data`` a stream, ``max_data`` the
    connection), raised once half a window has been delivered (fewer update
    frames), never lowered: data received but not delivered (held in a gap,
    or a reset stream's buffer) never exceeds the window. In-order data is
    handed to hypercorn as it arrives, which is what "delivered" means here.
    The two methods are aioquic's own, with the rule that raises a limit
    changed (a fix upstream would change just that).
    """

    def _delivered(self) -> int:
        """Bytes delivered in order on every stream: all received (the
        connection limit's ``used``, gaps included), less what open streams
        still hold beyond their delivered offset."""
        held = sum(stream.receiver.highest_offset - stream.receiver.starting_offset()
                   for stream in self._streams.values() if not stream.receiver.is_finished)
        return self._local_max_data.used - held

    def _write_connection_limits(self, builder: QuicPacketBuilder,
                                 space: QuicPacketSpace) -> None:
        max_data = self._local_max_data
        window = self._configuration.max_data
        wanted = self._delivered() + window
        if wanted - max_data.value >= window // 2:
            max_data.value = wanted
        for limit in (max_data, self._local_max_streams_bidi, self._local_max_streams_uni):
            if limit is not max_data and limit.sent - limit.used >= limit.value - limit.sent:
                continue  # aioquic's batching of MAX_STREAMS
            if limit.value != limit.sent:
                buf = builder.start_frame(limit.frame_type,
                                          capacity=CONNECTION_LIMIT_FRAME_CAPACITY,
                                          handler=self._on_connection_limit_delivery,
                                          handler_args=(limit,))
                buf.push_uint_var(limit.value)
                limit.sent = limit.value
                if self._quic_logger is not None and builder.quic_logger_frames is not None:
                    builder.quic_logger_frames.append(
                        self._quic_logger.encode_connection_limit_frame(
                            frame_type=limit.frame_type, maximum=limit.value))

    def _write_stream_limits(self, builder: QuicPacketBuilder, space: QuicPacketSpace,
                             stream: QuicStream) -> None:
        # 0: a stream we opened for sending only; nothing to raise.
        if stream.max_stream_data_local and not stream.receiver.is_finished:
            window = self._configuration.max_stream_data
            wanted = stream.receiver.starting_offset() + window
            if wanted - stream.max_stream_data_local >= window // 2:
                stream.max_stream_data_local = wanted
        stream_id = stream.stream_id
        if stream.max_stream_data_local_sent != stream.max_stream_data_local and stream_id is not None:
            buf = builder.start_frame(QuicFrameType.MAX_STREAM_DATA,
                                      capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                                      handler=self._on_max_stream_data_delivery,
                                      handler_args=(stream,))
            buf.push_uint_var(stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local
            if self._quic_logger is not None and builder.quic_logger_frames is not None:
                builder.quic_logger_frames.append(
                    self._quic_logger.encode_max_stream_data_frame(
                        maximum=stream.max_stream_data_local, stream_id=stream_id))


def install(*, session_ticket_fetcher: SessionTicketFetcher,
            session_ticket_handler: SessionTicketHandler) -> None:
    """Idempotent: the first call's callbacks stay (they belong to the process's store)."""
    require(QuicConnection, "_write_connection_limits", "_write_stream_limits",
            "_on_connection_limit_delivery", "_on_max_stream_data_delivery", patch=NAME)
    factory: Any = functools.partial(BoundedQuicConnection,
                                     session_ticket_fetcher=session_ticket_fetcher,
                                     session_ticket_handler=session_ticket_handler)
    replace(hypercorn.protocol.quic, "QuicConnection", factory, patch=NAME)
