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

``install_h2_guard`` wraps ``_handle_events`` (where:
``hedgerow.http_stack.h2_protocol``): DATA for a stream hypercorn no
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

Each connection also spends from an ``H2Budget`` (``gateway.edge.h2_budget``):
streams, client resets, PINGs, SETTINGS and empty frames, counted one read
at a time; WINDOW_UPDATE frames against the DATA frames sent; RST_STREAM
frames h2 answers protocol errors with. h2 drops a WINDOW_UPDATE for a
closed stream, and resets a stream written to after it closed, without an
event, so those are counted on the connection's h2 state machine itself,
as it parses and sends (``_count_frames``: its WINDOW_UPDATE handler,
``receive_data``, ``_prepare_for_sending`` and ``send_data``, wrapped on
each connection when hypercorn starts it). A client past a budget gets GOAWAY (ENHANCE_YOUR_CALM) and the
connection closes, as nginx and Envoy answer HTTP/2 floods. And after
``config.keep_alive_max_requests`` streams a connection drains gracefully:
GOAWAY (NO_ERROR) naming the last stream it will serve, which with every
stream before it runs to its end; later streams are not processed (the
GOAWAY tells the client so: safe to retry) and the connection closes once
the last END_STREAM is out. Hypercorn's own check
closes the h2 state machine at once, which cut every stream in flight.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import h2.events
from h2.errors import ErrorCodes
from h2.exceptions import StreamClosedError
from h2.settings import SettingCodes
from h2.connection import H2Connection
from hyperframe.frame import GoAwayFrame
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h2 import H2Protocol

from gateway.edge.h2_budget import VERDICTS, H2Budget, H2Limits
from hedgerow.http_stack import h2_protocol, linger
from hedgerow.http_stack.versions import PINNED

_log = logging.getLogger("hedgerow.gateway")

_STATE = "_hedgerow_guard"
DEFAULT_LIMITS = H2Limits()


# A cut is logged at most this often (with how many were not): an attacker
# must not be able to write a log line per connection it opens.
LOG_EVERY_S = 10.0


class H2GuardStats:
    """Connections cut per budget and drained, for the whole process (every
    hypercorn listener shares the patched class); read by the metrics."""

    def __init__(self) -> None:
        self.cut: Counter[str] = Counter()
        self.drained = 0
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    def count_cut(self, verdict: str, peer: str, now: float) -> None:
        self.cut[verdict] += 1
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        _log.warning("HTTP/2 client %s cut: over its %s budget (GOAWAY ENHANCE_YOUR_CALM; "
                     "%d more cut since the last such line; --h2-limit)",
                     peer, verdict, self._unlogged)
        self._logged_at, self._unlogged = now, 0

    def snapshot(self) -> dict[str, Any]:
        return {"cut": {reason: self.cut[reason] for reason in VERDICTS},
                "drained": self.drained}


H2_GUARD_STATS = H2GuardStats()


class _Guard:
    """What the guard keeps on one connection."""

    def __init__(self, limits: H2Limits, now: float) -> None:
        self.budget = H2Budget(limits, now)
        self.cut = False
        self.drain_after: int | None = None  # the last stream served, once draining
        self.served = 0  # streams handed to the app
        self.last_served = 0  # the highest of them: a GOAWAY names it
        # WINDOW_UPDATE frames h2 parsed in the read being handled.
        self.window_updates = 0
        # RST_STREAM frames h2 queued itself while parsing that read.
        self.error_resets = 0
        self.parsing = False


# The versions these patches were written and tested against (pinned and
# checked at start: ``hedgerow.http_stack.versions``).
HYPERCORN_VERSION = PINNED["hypercorn"]
H2_VERSION = PINNED["h2"]


def install_h2_guard() -> None:
    """Wrap ``H2Protocol._handle_events``, ``stream_send``, ``_send_data``,
    ``_close_stream`` and ``initiate`` (``hedgerow.http_stack.h2_protocol``);
    idempotent."""

    def make_initiate(initiate: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded_initiate(self: H2Protocol, *args: Any, **kwargs: Any) -> None:
            _guard(self)  # counting from the first byte the client sends
            await initiate(self, *args, **kwargs)
        return guarded_initiate

    def make_handle_events(handle: Callable[..., Any]) -> Callable[..., Any]:
        async def handle_events(self: H2Protocol, events: list[h2.events.Event],
                                *args: Any, **kwargs: Any) -> None:
            guard = _guard(self)
            if guard.cut:
                return
            # The whole read is charged before any of it is acted on: h2 parsed
            # it at once, so a reset in it arrived before any answer we would
            # send while handling it (as Envoy, which handles a read in one go,
            # sees it), and an abuser's last read starts no work at all.
            verdict = _charge(guard, events, self.context.time())
            if verdict is not None:
                await _calm(self, guard, verdict)
                return
            # One event at a time: a stream exists only once the RequestReceived
            # before its DATA in the same read has been handled. Flushed once,
            # at the end of the read, as hypercorn itself does.
            reset = _reset_streams(events)
            h2_protocol.hold_flushes(self)
            try:
                for event in events:
                    if guard.cut:
                        return  # drained and closed
                    if _beyond_goaway(guard, event) or _stillborn(event, reset):
                        guard.budget.stream_closed(event.stream_id)  # type: ignore[attr-defined]
                    elif _refused_while_draining(self, event):
                        guard.budget.stream_closed(event.stream_id)  # type: ignore[attr-defined]
                    elif not _late_data(self, event):
                        await handle(self, [event], *args, **kwargs)
                        if isinstance(event, h2.events.RequestReceived):
                            await _drain_when_due(self, guard, event.stream_id)
            finally:
                await h2_protocol.release_flushes(self)
        return handle_events

    def make_stream_send(stream_send: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded_stream_send(self: H2Protocol, event: Any, *args: Any,
                                      **kwargs: Any) -> None:
            await stream_send(self, event, *args, **kwargs)
            if isinstance(event, StreamClosed):
                await _close_if_drained(self)
        return guarded_stream_send

    def make_send_data(send_data: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded_send_data(self: H2Protocol, *args: Any, **kwargs: Any) -> None:
            await send_data(self, *args, **kwargs)
            await _close_if_drained(self)
        return guarded_send_data

    def make_close_stream(close_stream: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded_close_stream(self: H2Protocol, stream_id: int, *args: Any,
                                       **kwargs: Any) -> None:
            _guard(self).budget.stream_closed(stream_id)
            await close_stream(self, stream_id, *args, **kwargs)
        return guarded_close_stream

    h2_protocol.install(make_initiate=make_initiate, make_handle_events=make_handle_events,
                        make_stream_send=make_stream_send, make_send_data=make_send_data,
                        make_close_stream=make_close_stream)


def _guard(protocol: Any) -> _Guard:
    guard: _Guard | None = getattr(protocol, _STATE, None)
    if guard is None:
        limits = getattr(protocol.config, "h2_limits", DEFAULT_LIMITS)
        guard = _Guard(limits, protocol.context.time())
        setattr(protocol, _STATE, guard)
        _count_frames(protocol.connection, guard)
    return guard


def _count_frames(connection: H2Connection, guard: _Guard) -> None:
    """Charge every WINDOW_UPDATE frame h2 parses and every RST_STREAM it
    answers with while parsing, and count every DATA frame it is asked to
    send, on this one connection. h2 drops a WINDOW_UPDATE for a closed
    stream without an event, and resets a stream the client keeps writing to
    after it closed without one either, so events alone would miss a flood
    of them."""

    def window_update() -> None:
        guard.window_updates += 1  # charged with the read's events (``_charge``)

    def error_resets(count: int) -> None:
        guard.error_resets += count

    h2_protocol.hook_frames(connection, on_window_update=window_update,
                            on_reset_while_parsing=error_resets,
                            on_data_frame_sent=guard.budget.data_frame_sent)


def _charge(guard: _Guard, events: list[h2.events.Event], now: float) -> str | None:
    """Charge one read's RST_STREAM frames h2 answered it with, its events,
    then its WINDOW_UPDATE frames, to the connection's budget; the first
    verdict."""
    budget = guard.budget
    budget.begin_read()
    updates, guard.window_updates = guard.window_updates, 0
    resets, guard.error_resets = guard.error_resets, 0
    # The read's error resets first: a read that crosses that budget also
    # opens many streams, and the verdict should name the abuse.
    if resets and (verdict := budget.error_resets_sent(resets)) is not None:
        return verdict
    for event in events:
        verdict = _spend(budget, event, now)
        if verdict is not None:
            return verdict
    return budget.window_updates_received(updates) if updates else None


def _spend(budget: H2Budget, event: h2.events.Event, now: float) -> str | None:
    """Charge ``event`` to the connection's budget; the verdict when overspent."""
    if isinstance(event, h2.events.RequestReceived):
        return budget.stream_opened(event.stream_id, now)
    if isinstance(event, h2.events.StreamReset):
        if event.remote_reset:
            return budget.stream_reset_by_client(event.stream_id, now)
        return budget.reset_sent()
    if isinstance(event, h2.events.PingReceived):
        return budget.ping(now)
    if isinstance(event, h2.events.RemoteSettingsChanged):
        return budget.settings_frame(now)
    if isinstance(event, h2.events.DataReceived):
        return budget.frame_payload(event.flow_controlled_length == 0
                                    and event.stream_ended is None)
    if isinstance(event, h2.events.PriorityUpdated):
        return budget.priority_frame()
    if isinstance(event, h2.events.TrailersReceived):
        return budget.frame_payload(not event.headers)
    return None


async def _calm(protocol: Any, guard: _Guard, verdict: str) -> None:
    """GOAWAY (ENHANCE_YOUR_CALM) and close: what nginx and Envoy do to a flood."""
    guard.cut = True
    peer = protocol.client[0] if protocol.client else "?"
    H2_GUARD_STATS.count_cut(verdict, peer, protocol.context.time())
    # h2 acknowledged the read's PINGs and SETTINGS as it parsed them; an
    # abuser gets none of those ACKs (nothing else is pending: every event
    # handled so far was flushed).
    protocol.connection.clear_outbound_data_buffer()
    # The last stream named is the last one processed (RFC 9113, 6.8), not
    # the last one h2 parsed: the overspending read was never acted on.
    protocol.connection.close_connection(error_code=ErrorCodes.ENHANCE_YOUR_CALM,
                                         last_stream_id=guard.last_served)
    await h2_protocol.flush_now(protocol)
    with linger.at_once():  # an abuser's further bytes are not read (http_stack.linger)
        await protocol.send(Closed())


def _reset_streams(events: list[h2.events.Event]) -> set[int]:
    return {event.stream_id for event in events if isinstance(event, h2.events.StreamReset)}


def _stillborn(event: h2.events.Event, reset: set[int]) -> bool:
    """A new stream reset in the read that opened it, by the client (Rapid
    Reset) or by h2 for the client's protocol error (a reset flood): h2 has
    closed it already, so it starts no work. Hypercorn would start the app
    for it and cancel it at once; an abuser's hundred such streams a read
    each cost a whole request (~20 ms on a loaded test machine) and delayed
    everyone else's by seconds. Its StreamReset finds no stream and is a
    no-op; DATA before the reset is settled as late data."""
    return isinstance(event, h2.events.RequestReceived) and event.stream_id in reset


def _beyond_goaway(guard: _Guard, event: h2.events.Event) -> bool:
    """A stream beyond the last one a draining connection promised to serve:
    left alone. The GOAWAY already told the client it was not processed and
    may be retried (RFC 9113, 6.8); a RST_STREAM on top of it made h2-based
    clients (httpx) fail the request instead of retrying it, as seen here."""
    return (isinstance(event, h2.events.RequestReceived) and guard.drain_after is not None
            and event.stream_id > guard.drain_after)


async def _drain_when_due(protocol: Any, guard: _Guard, stream_id: int) -> None:
    """After ``keep_alive_max_requests`` streams: GOAWAY naming this stream as
    the last, leaving h2's state open so the streams in flight finish. The
    frame is written beside h2 (it has no "graceful GOAWAY" call: its
    ``close_connection`` also forbids sending anything after it)."""
    guard.served += 1
    guard.last_served = max(guard.last_served, stream_id)
    if guard.drain_after is not None or guard.served < protocol.config.keep_alive_max_requests:
        return
    guard.drain_after = stream_id
    H2_GUARD_STATS.drained += 1
    await h2_protocol.flush_now(protocol)  # what h2 queued goes before the raw GOAWAY
    frame = GoAwayFrame(0, last_stream_id=stream_id, error_code=ErrorCodes.NO_ERROR)
    await protocol.send(RawData(data=frame.serialize()))


async def _close_if_drained(protocol: Any) -> None:
    """Close a draining connection once its last stream's END_STREAM is out.
    A stream reports StreamClosed as soon as its body is handed over, before
    the sending task has framed it; that task drops the stream's buffer only
    after END_STREAM, so "no streams and no buffers" means all was sent."""
    guard = _guard(protocol)
    if (guard.drain_after is None or guard.cut or protocol.closed or protocol.streams
            or protocol.stream_buffers):
        return
    guard.cut = True
    protocol.connection.close_connection(last_stream_id=guard.drain_after)
    await h2_protocol.flush_now(protocol)
    await protocol.send(Closed())


def _refused_while_draining(protocol: Any, event: h2.events.Event) -> bool:
    """A new stream on a connection of a server that is shutting down: refuse it
    with REFUSED_STREAM, which tells the client that nothing was processed and a
    retry elsewhere is safe (RFC 9113, 8.7). Hypercorn resets it with NO_ERROR,
    which promises nothing, and clients report a failure."""
    if not isinstance(event, h2.events.RequestReceived) or not protocol.context.terminated.is_set():
        return False
    connection = protocol.connection
    _refuse(connection, event.stream_id)
    connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 0})
    return True


def _refuse(connection: Any, stream_id: int) -> None:
    try:
        connection.reset_stream(stream_id, error_code=ErrorCodes.REFUSED_STREAM)
    except StreamClosedError:
        # h2 parses a whole read before we see its first event: a RST_STREAM
        # later in the same read already closed the stream; nothing to refuse.
        pass


def _late_data(protocol: Any, event: h2.events.Event) -> bool:
    """Whether ``event`` is DATA for a forgotten stream (and, if so, settle it)."""
    if not isinstance(event, h2.events.DataReceived) or event.stream_id in protocol.streams:
        return False
    connection = protocol.connection
    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
    return True
