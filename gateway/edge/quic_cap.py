"""The QUIC front door: what it does to hypercorn 0.18.0 / aioquic 1.7.2's QUIC.

Where each piece plugs in (and the checks that it still can) is
``hedgerow.http_stack.quic_front_door`` and ``.quic_connection``; this module
holds the behaviour.

Hypercorn's ``QuicProtocol`` makes a connection (and starts a TLS handshake)
for every Initial packet with an unknown destination connection id, without
limit, never sends a Retry, and lets a half-open connection sit for aioquic's
60 s idle timeout; aioquic's ``H3Connection`` buffers a HEADERS frame of any
declared size and offers a 4 KiB QPACK dynamic table. Here, in front of that
(decisions in ``gateway.edge.quic_admission``, sans-IO):

1. ``screen_datagram``, called from the UDP server's ``datagram_received``
   before hypercorn's 10-slot packet queue: an Initial for an unknown
   connection that is to be Retried, refused or dropped is answered (or not)
   right there, so a flood of them never takes the queue slots that the
   packets of open connections need.
2. ``QuicProtocol.handle`` builds admitted connections itself (the lines of
   hypercorn's own, plus aioquic's ``original_destination_connection_id`` /
   ``retry_source_connection_id`` after a Retry), takes the client's slots
   of the per-client limits and one of the ``ConnectionCap`` (both shared
   with TCP) and starts a handshake timer; everything else goes to
   hypercorn's ``handle`` unchanged.
3. ``QuicProtocol._handle_events`` reports each connection's handshake done
   (aioquic's ``_handshake_complete``) and its end (hypercorn forgets its ids)
   to the door, which frees the slots.
   Version Negotiation packets are dropped there too (hypercorn answered
   them with its own: a reflection loop between two servers).
4. ``hypercorn.protocol.h3.H3Connection`` becomes ``BoundedH3Connection``:
   field-section limit (advertised as SETTINGS_MAX_FIELD_SECTION_SIZE, a
   larger HEADERS frame refused as soon as its header is parsed, before its
   payload is buffered; the request answered 431 on its stream, the
   connection closed only when a client keeps doing it), QPACK table and
   blocked-streams limits.
5. Connections are ``BoundedQuicConnection``s
   (``hedgerow.http_stack.quic_connection``): flow-control windows that move
   with the data delivered, not double with the data received.
6. ``hypercorn.protocol.h3.H3Protocol.handle`` is ``guarded_h3_handle``.
   Hypercorn handles every HTTP/3 connection of a process in one task (the
   UDP server's), so one request could stop HTTP/3 for all of them: DATA
   after the response had ended raised ``KeyError`` there, a trailer
   section was taken for a new request (no ``:method``: ``UnboundLocalError``),
   both ending the UDP server; and a body chunk for an application that
   does not read (its queue holds 10) blocked the task for good. Now late
   DATA is dropped, trailers end the body, and a chunk the application has
   not taken within ``H3_BODY_WAIT_S`` stops that stream's body
   (STOP_SENDING H3_REQUEST_CANCELLED; the rest dropped), or at once once
   the application has ended. And a client that abandons a request (STOP_SENDING;
   a RESET_STREAM alone ends only the request's side) or whose connection ends
   is told to the application (``StreamClosed``), as over TCP; hypercorn never
   did. What the application still sends for it is dropped.

``install_quic_cap`` refuses to start when what it reaches into is missing
(``PatchError``); the versions are checked at process start
(``hedgerow.http_stack.check_versions``).
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from functools import partial
from typing import Any, Callable

import hypercorn.protocol.h3
import hypercorn.protocol.quic
import pylsqpack
from aioquic.asyncio.server import _encode_invalid_token_close
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.h3.connection import (
    ErrorCode,
    FrameType,
    H3Connection,
    H3Stream,
    HeadersState,
    ProtocolError,
    Setting,
)
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.packet import (
    PACKET_TYPE_INITIAL,
    QuicErrorCode,
    QuicHeader,
    encode_quic_retry,
    pull_quic_header,
)
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StopSendingReceived
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, StreamClosed
from hypercorn.protocol.h3 import H3Protocol
from hypercorn.protocol.quic import QuicProtocol, _Connection

from hedgerow.connection_cap import log_refusals
from hedgerow.http_stack import quic_front_door
from hedgerow.http_stack.disconnect_hook import fire_for
from hedgerow.http_stack.quic_cid import new_server_cid
from hedgerow.http_stack.quic_connection import BoundedQuicConnection as BoundedQuicConnection
from hedgerow.http_stack.versions import PINNED
from gateway.edge.quic_admission import Address, QuicFrontDoor, QuicLimits, Verdict

log = logging.getLogger("hedgerow.gateway.quic")

ASSUMED_VERSIONS = {name: PINNED[name] for name in ("hypercorn", "aioquic")}
# The front door in force, set by ``gateway.edge.transport.serve`` (a context
# variable, like ``ACTIVE_CAP``: hypercorn's UDP tasks inherit it).
ACTIVE_QUIC_DOOR: ContextVar[QuicFrontDoor | None] = ContextVar("quic_door", default=None)

_LONG_HEADER = 0x80
_MIN_INITIAL_BYTES = 1200  # RFC 9000 14.1; hypercorn ignores shorter Initials too
_CID_BYTES = 8


class HeaderSectionTooLarge(ProtocolError):
    error_code = ErrorCode.H3_EXCESSIVE_LOAD


class _RefuseRequest(Exception):
    """A request's header section over the limit: answered 431 on its own
    stream (never a ``ProtocolError``, which would close the connection)."""


# The answer to a request whose header section is over the limit (RFC 9114
# 4.2.2, RFC 6585 5); "connection: close" is not HTTP/3's, the stream ends.
_TOO_LARGE_BODY = b"request header fields too large\n"
_TOO_LARGE = [(b":status", b"431"), (b"content-type", b"text/plain"),
              (b"content-length", str(len(_TOO_LARGE_BODY)).encode())]


class BoundedH3Connection(H3Connection):
    """aioquic's ``H3Connection`` with the gateway's field-section and QPACK bounds.

    A request whose header section is over the limit -- its HEADERS frame
    declares more (refused as soon as the frame header is parsed, its payload
    never buffered), or it decodes to more -- is answered 431 on its stream,
    which is then read no further (STOP_SENDING H3_NO_ERROR, RFC 9114 4.1.1)
    and everything else it carries dropped: the client's other streams go on,
    as nginx answers such a request (400/494) and keeps the connection. Past
    ``h3_max_refused_header_sections`` such requests on one connection, or
    for trailers, the connection is closed with H3_EXCESSIVE_LOAD.
    """

    def _init_connection(self, *args: Any, **kwargs: Any) -> None:
        # Runs at the end of ``H3Connection.__init__``, before SETTINGS are
        # sent: the limits must be in place (and advertised) from the start.
        door = ACTIVE_QUIC_DOOR.get()
        self._hedgerow_door = door
        limits = door.limits if door is not None else QuicLimits()
        self._hedgerow_max_field_section = limits.h3_max_field_section_bytes
        self._hedgerow_max_refusals = limits.h3_max_refused_header_sections
        # Request streams answered 431: at most the refusals allowed, then the
        # connection closes. ``_hedgerow_to_answer``: those not answered yet.
        self._hedgerow_refused: set[int] = set()
        self._hedgerow_to_answer: list[tuple[int, bool]] = []
        self._hedgerow_receiving: H3Stream | None = None
        self._max_table_capacity = limits.h3_qpack_table_bytes
        self._blocked_streams = limits.h3_qpack_blocked_streams if limits.h3_qpack_table_bytes else 0
        self._decoder = pylsqpack.Decoder(self._max_table_capacity, self._blocked_streams)
        super()._init_connection(*args, **kwargs)

    def _get_local_settings(self, *args: Any, **kwargs: Any) -> dict[int, int]:
        settings = super()._get_local_settings(*args, **kwargs)
        settings[Setting.MAX_FIELD_SECTION_SIZE] = self._hedgerow_max_field_section
        return settings

    def handle_event(self, event: QuicEvent, *args: Any, **kwargs: Any) -> list[H3Event]:
        events = super().handle_event(event, *args, **kwargs)
        # Answered here, outside aioquic's stream bookkeeping (its
        # ``_get_or_create_stream`` would forget the stream twice if the
        # answer ended it while a receive held it).
        while self._hedgerow_to_answer and not self._is_done:
            stream_id, still_sending = self._hedgerow_to_answer.pop()
            self.send_headers(stream_id, _TOO_LARGE)
            self.send_data(stream_id, _TOO_LARGE_BODY, end_stream=True)
            if still_sending:
                self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        return events

    def _receive_request_or_push_data(self, stream: H3Stream, data: bytes,
                                      stream_ended: bool, *args: Any,
                                      **kwargs: Any) -> list[H3Event]:
        if stream.stream_id in self._hedgerow_refused:
            return []  # answered 431: the rest of the request is dropped unread
        self._hedgerow_receiving = stream
        try:
            return super()._receive_request_or_push_data(stream, data, stream_ended,
                                                         *args, **kwargs)
        except _RefuseRequest:
            self._hedgerow_refused.add(stream.stream_id)
            self._hedgerow_to_answer.append((stream.stream_id, not stream.receiving_ended))
            stream.buffer = b""
            return []
        finally:
            self._hedgerow_receiving = None

    def _check_request_or_push_frame_type(self, frame_type: int, stream: H3Stream,
                                          *args: Any, **kwargs: Any) -> None:
        super()._check_request_or_push_frame_type(frame_type, stream, *args, **kwargs)
        if frame_type == FrameType.HEADERS and (stream.frame_size or 0) > self._hedgerow_max_field_section:
            self._over_limit(stream, f"HEADERS frame of {stream.frame_size} bytes is over "
                                     f"{self._hedgerow_max_field_section}")

    def _decode_headers(self, stream_id: int, frame_data: bytes | None, *args: Any,
                        **kwargs: Any) -> list[tuple[bytes, bytes]]:
        headers = super()._decode_headers(stream_id, frame_data, *args, **kwargs)
        size = sum(len(name) + len(value) + 32 for name, value in headers)
        if size > self._hedgerow_max_field_section:
            self._over_limit(self._stream.get(stream_id), f"field section of {size} bytes is "
                                                          f"over {self._hedgerow_max_field_section}")
        return headers

    def _over_limit(self, stream: H3Stream | None, why: str) -> None:
        """Refuse the request (431), or, for trailers or past the refusals a
        connection is allowed, close the connection (H3_EXCESSIVE_LOAD)."""
        if self._hedgerow_door is not None:
            self._hedgerow_door.h3_headers_refused += 1
        if (stream is not None and stream is self._hedgerow_receiving
                and stream.headers_recv_state == HeadersState.INITIAL
                and len(self._hedgerow_refused) < self._hedgerow_max_refusals):
            raise _RefuseRequest(why)
        if self._hedgerow_door is not None:
            self._hedgerow_door.h3_connections_cut += 1
        raise HeaderSectionTooLarge(why)


# How long hypercorn's UDP task (all HTTP/3 connections of the process) waits
# for an application to take a body chunk when its queue is full.
H3_BODY_WAIT_S = 1.0
_BODY_POLL_S = 0.01


async def guarded_h3_handle(self: H3Protocol, quic_event: QuicEvent) -> None:
    """``H3Protocol.handle`` (hypercorn 0.18.0), with the guards of point 6."""
    for event in self.connection.handle_event(quic_event):
        if isinstance(event, HeadersReceived):
            if any(name.startswith(b":") for name, _ in event.headers):
                if not self.context.terminated.is_set():
                    await self._create_stream(event)
                    if event.stream_ended:
                        await _to_app(self, event.stream_id, EndBody(stream_id=event.stream_id))
            elif event.stream_ended:
                # A trailer section (no pseudo-headers, RFC 9114 4.1): hypercorn
                # has no request trailers; it ends the body.
                await _to_app(self, event.stream_id, EndBody(stream_id=event.stream_id))
        elif isinstance(event, DataReceived):
            await _to_app(self, event.stream_id,
                          Body(stream_id=event.stream_id, data=event.data))
            if event.stream_ended:
                await _to_app(self, event.stream_id, EndBody(stream_id=event.stream_id))
    if isinstance(quic_event, StopSendingReceived):
        # The client wants no more of the response: it left. A RESET_STREAM
        # alone ends only the request's side (RFC 9114 4.1.2; also the client's
        # answer to our own STOP_SENDING for a body nobody took): the response
        # is still wanted, and the application's body deadline handles it.
        await _client_left(self, quic_event.stream_id)
    elif isinstance(quic_event, ConnectionTerminated):
        for stream_id in list(self.streams):
            await _client_left(self, stream_id)


async def _client_left(protocol: Any, stream_id: int) -> None:
    """The client abandoned a request (STOP_SENDING on its stream: a browser's
    abort sends it with RESET_STREAM) or its whole connection ended: tell the
    application, as HTTP/1.1 and HTTP/2 do (``StreamClosed``: ``http.disconnect``
    and the ``hedgerow.disconnect`` hook), and forget the stream, so what
    still arrives for it is dropped. Hypercorn 0.18 does neither: a reader
    whose client closed its connection streamed on into nothing and its
    generation ran to ``max_tokens``. Never waits in the UDP task: when the
    application's queue is full (it is not reading), only the hook fires."""
    stream = protocol.streams.pop(stream_id, None)
    if stream is None:
        return  # not a request stream, or its response already ended
    queue = getattr(getattr(stream, "app_put", None), "__self__", None)
    if not isinstance(queue, asyncio.Queue) or not queue.full():
        await stream.handle(StreamClosed(stream_id=stream_id))
        return
    stream.closed = True
    fire_for(stream)


async def _to_app(protocol: Any, stream_id: int, event: Body | EndBody) -> None:
    """Hand ``event`` to the stream's application without holding the UDP task
    more than ``H3_BODY_WAIT_S``; dropped when the stream is gone or deaf."""
    stream = protocol.streams.get(stream_id)
    if stream is None or getattr(stream, "_hedgerow_deaf", False):
        return  # the response ended (hypercorn forgot the stream), or it stopped reading
    queue = getattr(getattr(stream, "app_put", None), "__self__", None)
    if not isinstance(queue, asyncio.Queue) or not queue.full():
        await stream.handle(event)  # does not wait: the queue has room (or none yet)
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + H3_BODY_WAIT_S
    while queue.full():
        if protocol.streams.get(stream_id) is not stream or stream.closed:
            return  # the application ended without reading it all
        if loop.time() > deadline:
            stream._hedgerow_deaf = True
            try:
                protocol.connection._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            except ValueError:
                pass  # the client already ended or reset its side
            log.info("HTTP/3 stream %d: the application took no body for %.1fs; the rest "
                     "of the body is refused", stream_id, H3_BODY_WAIT_S)
            return
        await asyncio.sleep(_BODY_POLL_S)
    await stream.handle(event)


def install_quic_cap() -> None:
    """Plug the front door into hypercorn's ``QuicProtocol`` and its HTTP/3
    (``hedgerow.http_stack.quic_front_door``); idempotent."""

    def make_handle(handle: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded_handle(self: Any, event: Any, *args: Any, **kwargs: Any) -> None:
            door = _door(self)
            header = _new_initial(self, event.data) if isinstance(event, RawData) else None
            if door is None or header is None:
                await handle(self, event, *args, **kwargs)
                return
            now = self.context.time()
            admission = door.screen(address=event.address, destination_cid=header.destination_cid,
                                    token=header.token, now=now)
            if admission.verdict is not Verdict.ADMIT:
                answer = _answer(door, admission.verdict, header, event.address, now)
                if answer is not None:
                    await self.send(RawData(data=answer, address=event.address))
                _log(door)
                return
            await _open(self, door, header, event, admission.original_destination_cid,
                        admission.retry_source_cid, now)
        return guarded_handle

    def make_handle_events(handle_events: Callable[..., Any]) -> Callable[..., Any]:
        async def tracked_handle_events(self: Any, connection: Any, *args: Any,
                                        **kwargs: Any) -> None:
            await handle_events(self, connection, *args, **kwargs)
            door = getattr(self, "_hedgerow_door", None)
            key = id(connection)
            if door is None or not door.tracks(key):
                return
            if not connection.cids:  # terminated: hypercorn forgot its ids
                door.closed(key, self.context.time())
                await _stop_guard(self, key)
            elif door.is_half_open(key) and connection.quic._handshake_complete:
                door.established(key)
                await _stop_guard(self, key)
        return tracked_handle_events

    def make_stream_send(stream_send: Callable[..., Any]) -> Callable[..., Any]:
        async def forgotten_dropped(self: Any, event: Any, *args: Any, **kwargs: Any) -> None:
            # A stream is in ``streams`` from its HEADERS until its application
            # ends it; one that is not, yet still sent for, is one
            # ``_client_left`` forgot: its client is gone. Dropped, not handed to
            # aioquic, which would raise into the application ("Cannot send data
            # on a finished stream") and keep a new H3 stream for it till the end.
            stream_id = getattr(event, "stream_id", None)
            if (stream_id is not None and stream_id not in self.streams
                    and not isinstance(event, StreamClosed)):
                return
            await stream_send(self, event, *args, **kwargs)
        return forgotten_dropped

    quic_front_door.install(make_handle=make_handle, make_handle_events=make_handle_events,
                            h3_handle=guarded_h3_handle, h3_connection=BoundedH3Connection,
                            make_stream_send=make_stream_send)


def screen_datagram(protocol: QuicProtocol | None, data: bytes, address: Address,
                    send: Callable[[bytes, Address], None], now: float) -> bool:
    """Whether to queue ``data`` for hypercorn; a Retry or close is sent here."""
    if len(data) >= 5 and data[0] & _LONG_HEADER and data[1:5] == b"\0\0\0\0":
        # A Version Negotiation packet: hypercorn would answer it with one of
        # its own (version 0 is not one it speaks), so two servers -- or a
        # spoofed source naming another one -- could bounce them forever.
        # aioquic's own server drops them; a server never needs one.
        return False
    if protocol is None:
        return True
    door = _door(protocol)
    header = _new_initial(protocol, data) if door is not None else None
    if door is None or header is None:
        return True
    admission = door.screen(address=address, destination_cid=header.destination_cid,
                            token=header.token, now=now)
    if admission.verdict is Verdict.ADMIT:
        return True  # ``guarded_handle`` decides again, and opens it
    answer = _answer(door, admission.verdict, header, address, now)
    if answer is not None:
        send(answer, address)
    _log(door)
    return False


async def _open(protocol: Any, door: QuicFrontDoor, header: QuicHeader, event: RawData,
                original_cid: bytes, retry_cid: bytes | None, now: float) -> None:
    # hypercorn.protocol.quic.QuicProtocol.handle's own lines, with the ids
    # aioquic needs after a Retry. ``hypercorn.protocol.quic.QuicConnection``
    # is looked up at call time: ``gateway.edge.transport`` adds the ticket hooks.
    quic = hypercorn.protocol.quic.QuicConnection(  # type: ignore[attr-defined]
        configuration=protocol.quic_config,
        original_destination_connection_id=original_cid,
        retry_source_connection_id=retry_cid,
    )
    connection = _Connection(cids={header.destination_cid, quic.host_cid}, quic=quic,
                             task=protocol.context.single_task_class())
    key = id(connection)
    if not door.open(key, event.address or ("", 0), now):
        _log(door)
        return
    protocol.connections[header.destination_cid] = connection
    protocol.connections[quic.host_cid] = connection
    guard = protocol.context.single_task_class()
    protocol._hedgerow_guards[key] = guard
    await guard.restart(protocol.task_group, partial(_expire, protocol, door, connection))
    quic.receive_datagram(event.data, event.address, now=now)
    await protocol._handle_events(connection, event.address)


async def _expire(protocol: Any, door: QuicFrontDoor, connection: Any) -> None:
    """Close a connection whose handshake is not done within the timeout."""
    await protocol.context.sleep(door.limits.handshake_timeout_s)
    key = id(connection)
    protocol._hedgerow_guards.pop(key, None)  # this task: never stopped by itself
    if not door.is_half_open(key) or not connection.cids:
        return
    connection.quic.close(error_code=QuicErrorCode.CONNECTION_REFUSED,
                          reason_phrase="handshake timeout")
    for data, address in connection.quic.datagrams_to_send(now=protocol.context.time()):
        await protocol.send(RawData(data=data, address=address))
    # Forget it now, not after aioquic's closing period: its slot is free at once.
    await connection.task.stop()
    for cid in connection.cids:
        protocol.connections.pop(cid, None)
    connection.cids = set()
    door.closed(key, protocol.context.time(), timed_out=True)


async def _stop_guard(protocol: Any, key: int) -> None:
    guard = protocol._hedgerow_guards.pop(key, None)
    if guard is not None:
        await guard.stop()


def _door(protocol: Any) -> QuicFrontDoor | None:
    """The door of the server this protocol belongs to, fixed at its first packet
    (when the flow-control windows are set too)."""
    try:
        return protocol._hedgerow_door  # type: ignore[no-any-return]
    except AttributeError:
        door = ACTIVE_QUIC_DOOR.get()
        protocol._hedgerow_door = door
        protocol._hedgerow_guards = {}
        if door is not None:
            protocol.quic_config.max_data = door.limits.max_data_bytes
            protocol.quic_config.max_stream_data = door.limits.max_stream_data_bytes
        return door


def _new_initial(protocol: Any, data: bytes) -> QuicHeader | None:
    """The header of an Initial that would open a connection (long header,
    a version we speak, an unknown destination id, at least 1200 bytes, not
    shutting down); None for every other packet (hypercorn's business)."""
    if len(data) < _MIN_INITIAL_BYTES or not data[0] & _LONG_HEADER:
        return None
    try:
        header = pull_quic_header(Buffer(data=data), host_cid_length=_CID_BYTES)
    except ValueError:
        return None
    if (header.packet_type != PACKET_TYPE_INITIAL
            or header.version not in protocol.quic_config.supported_versions
            or header.destination_cid in protocol.connections
            or protocol.context.terminated.is_set()):
        return None
    return header


def _answer(door: QuicFrontDoor, verdict: Verdict, header: QuicHeader, address: Address,
            now: float) -> bytes | None:
    assert header.version is not None  # _new_initial checked it
    if verdict is Verdict.RETRY:
        # Steered like the host ids: the client's next Initial, addressed to it,
        # reaches this process, the one whose key sealed the token.
        retry_cid = new_server_cid(_CID_BYTES)
        return encode_quic_retry(
            version=header.version, source_cid=retry_cid, destination_cid=header.source_cid,
            original_destination_cid=header.destination_cid,
            retry_token=door.retry_token(address, header.destination_cid, retry_cid, now))
    if verdict is Verdict.INVALID_TOKEN:
        return _encode_invalid_token_close(version=header.version,
                                           source_cid=header.destination_cid,
                                           destination_cid=header.source_cid)
    return None


def _log(door: QuicFrontDoor) -> None:
    if door.cap is not None:
        log_refusals(door.cap)
        # The per-client limits' refusals, TCP's and QUIC's in one count, at
        # most one line per connection_cap.LOG_EVERY_S whichever logs it.
        refused = door.cap.source_refusals_to_log(asyncio.get_running_loop().time())
        if refused:
            log.warning("per-client connection limits: %d connection(s) refused (TCP closed "
                        "at accept, QUIC Initials dropped; --max-connections-per-ip/-prefix, "
                        "--new-connections-per-ip/-prefix)", refused)
