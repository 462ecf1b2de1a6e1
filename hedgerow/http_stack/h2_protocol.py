"""Where the gateway's HTTP/2 guard plugs into hypercorn's ``H2Protocol`` and h2.

Changes (hypercorn 0.18.0, h2 4.4.1), with behaviour supplied by
``gateway.edge.h2_guard``:

- ``H2Protocol.initiate``, ``_handle_events``, ``stream_send``,
  ``_send_data`` and ``_close_stream`` wrapped by the guard's factories
  (late DATA dropped instead of a ``KeyError`` that killed the connection,
  pgjones/hypercorn#329, upstream: ``docs/upstream/h2-late-data.patch``;
  REFUSED_STREAM during shutdown; per-connection flood budgets; a graceful
  drain after ``keep_alive_max_requests``).
- ``H2Protocol._flush`` wrapped so that a read's events are flushed once:
  between ``hold_flushes(protocol)`` and ``release_flushes(protocol)`` a
  flush from the task that holds them is deferred to the release. Hypercorn
  itself flushes once per read; the guard has to hand hypercorn one event at
  a time (a stream exists only once its RequestReceived has been handled),
  and without this each event was a flush (``data_to_send``, a send under
  the connection's lock, a ``drain``). Flushes from other tasks (the
  application's, the sending task) are never held.
- ``hook_frames(connection, ...)``: on one ``h2.connection.H2Connection``
  instance, its WINDOW_UPDATE entry of ``_frame_dispatch_table``,
  ``receive_data``, ``_prepare_for_sending`` and ``send_data`` are wrapped to
  count what h2 handles without an event (a WINDOW_UPDATE for a closed
  stream, the RST_STREAM it answers a protocol error with, each DATA frame
  sent).

If the internals moved: ``PatchError`` at install, naming what is missing
(the six ``H2Protocol`` methods; the four ``H2Connection`` attributes,
checked on a throwaway connection). Wrappers pass ``*args, **kwargs``
through. ``tests/unit/test_http_stack_h2_protocol.py`` shows late DATA
surviving and one flush per read on a real connection.

Scope: process (every HTTP/2 connection); the budgets are the listener's
(``config.h2_limits``, defaults elsewhere).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from h2.connection import H2Connection
from hyperframe.frame import Frame, RstStreamFrame, WindowUpdateFrame
from hypercorn.protocol.h2 import H2Protocol

from hedgerow.http_stack.patch import PatchError, original, require, wrap

NAME = "h2_protocol"
_HOLDER = "_hedgerow_flush_holder"

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def install(*, make_initiate: Wrapper, make_handle_events: Wrapper, make_stream_send: Wrapper,
            make_send_data: Wrapper, make_close_stream: Wrapper) -> None:
    """Idempotent: the first call's behaviour stays."""
    require(H2Protocol, "initiate", "_handle_events", "stream_send", "_send_data",
            "_close_stream", "_flush", patch=NAME)
    _check_h2_connection()
    wrap(H2Protocol, "_flush", _make_flush, patch=NAME)
    wrap(H2Protocol, "initiate", make_initiate, patch=NAME)
    wrap(H2Protocol, "_handle_events", make_handle_events, patch=NAME)
    wrap(H2Protocol, "stream_send", make_stream_send, patch=NAME)
    wrap(H2Protocol, "_send_data", make_send_data, patch=NAME)
    wrap(H2Protocol, "_close_stream", make_close_stream, patch=NAME)


def _check_h2_connection() -> None:
    """What ``hook_frames`` reaches into, checked on a throwaway connection at install."""
    probe = H2Connection()
    require(probe, "_frame_dispatch_table", "_prepare_for_sending", "receive_data",
            "send_data", patch=NAME)
    if WindowUpdateFrame not in probe._frame_dispatch_table:
        raise PatchError(f"hedgerow.http_stack.{NAME} cannot be applied: h2's "
                         "H2Connection._frame_dispatch_table has no WindowUpdateFrame entry")


def _make_flush(flush: Callable[..., Any]) -> Callable[..., Any]:
    async def held_flush(self: Any, *args: Any, **kwargs: Any) -> None:
        holder = getattr(self, _HOLDER, None)
        if holder is not None and holder is asyncio.current_task():
            return  # ``release_flushes`` sends it with the rest of the read
        await flush(self, *args, **kwargs)
    return held_flush


def hold_flushes(protocol: Any) -> None:
    """Defer this task's flushes of ``protocol`` until ``release_flushes``."""
    setattr(protocol, _HOLDER, asyncio.current_task())


async def release_flushes(protocol: Any) -> None:
    """Stop holding, and flush once (nothing is sent if h2 has nothing queued)."""
    setattr(protocol, _HOLDER, None)
    await flush_now(protocol)


async def flush_now(protocol: Any) -> None:
    """Flush at once, held or not (a GOAWAY must follow what h2 has queued)."""
    await original(NAME, H2Protocol, "_flush")(protocol)


def hook_frames(connection: H2Connection, *, on_window_update: Callable[[], None],
                on_reset_while_parsing: Callable[[int], None],
                on_data_frame_sent: Callable[[], None]) -> None:
    """Count, on this one connection: every WINDOW_UPDATE frame h2 parses, the
    RST_STREAM frames it queues while parsing the client's bytes (its answers
    to protocol errors), and every DATA frame it is asked to send. h2's
    dispatch table is per instance (``H2Connection.__init__``)."""
    table = connection._frame_dispatch_table
    receive_window_update = table[WindowUpdateFrame]
    send_data = connection.send_data
    receive_data = connection.receive_data
    prepare_for_sending = connection._prepare_for_sending
    parsing = [False]

    def parsed(*args: Any, **kwargs: Any) -> Any:
        parsing[0] = True
        try:
            return receive_data(*args, **kwargs)
        finally:
            parsing[0] = False

    def counted_prepare(frames: list[Frame], *args: Any, **kwargs: Any) -> Any:
        # While parsing, every frame h2 queues answers the client's bytes;
        # our own resets, and hypercorn's, are sent outside ``receive_data``.
        if parsing[0]:
            resets = sum(isinstance(frame, RstStreamFrame) for frame in frames)
            if resets:
                on_reset_while_parsing(resets)
        return prepare_for_sending(frames, *args, **kwargs)

    def counted_window_update(*args: Any, **kwargs: Any) -> Any:
        on_window_update()
        return receive_window_update(*args, **kwargs)

    def counted_send_data(*args: Any, **kwargs: Any) -> Any:
        result = send_data(*args, **kwargs)
        on_data_frame_sent()  # hypercorn sends one frame a call
        return result

    table[WindowUpdateFrame] = counted_window_update
    connection.send_data = counted_send_data  # type: ignore[method-assign]
    connection.receive_data = parsed  # type: ignore[method-assign]
    connection._prepare_for_sending = counted_prepare  # type: ignore[method-assign]
