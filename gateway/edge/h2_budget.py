"""Per-connection budgets against HTTP/2 floods (sans-IO; ``now`` injected).

One ``H2Budget`` per HTTP/2 connection is fed what the client sent, one
read (an "I/O cycle") at a time, and answers with the name of the budget the
client overspent, or None. The adapter (``gateway.edge.h2_guard``) then sends
GOAWAY (ENHANCE_YOUR_CALM) and closes the connection, as nginx and Envoy do.

The attacks and what answers each (defaults in ``H2Limits``):

- Rapid Reset (CVE-2023-44487): streams opened and reset at once. Envoy's
  "premature reset" rule: a stream reset by the client within
  ``premature_reset_lifetime_s`` of opening is premature; the connection is
  cut once premature resets reach half of ``premature_reset_window`` streams
  (or half of all closed streams beyond it). Also nginx 1.25.3's rule: at
  most ``max_new_streams_per_read`` new streams in one read (2 x max
  concurrent streams there). And a token bucket on new streams per second.
- Reset flood (CVE-2019-9514): frames that make the server answer with
  RST_STREAM (DATA or HEADERS on a closed stream, and the like). h2 sends
  those itself, often without an event, so the adapter counts the RST_STREAM
  frames h2 queues while it parses the client's bytes. A client that obeys
  the protocol causes none (at most a few in a race with a stream the server
  cancelled), so at most ``max_error_resets`` of them in a connection's life
  (hyper's h2 crate, its fix for this: ``max_local_error_reset_streams``,
  1024; Envoy goes further and by default answers such messaging with a
  connection error at once: ``stream_error_on_invalid_http_messaging``
  false). Counted, not timed: the abuser is cut after the same number of
  streams however fast the gateway's CPU is.
- Ping flood (CVE-2019-9512) and settings flood (CVE-2019-9515): token
  buckets per connection; and every PING and SETTINGS obliges us to queue an
  ACK, so at most ``max_control_frames_per_read`` of them per read (Envoy
  bounds its outbound control-frame queue at 1000). Past one read the queue
  is bounded by backpressure: hypercorn stops reading while a write drains.
- Empty frames (CVE-2019-9518): at most ``max_consecutive_empty_frames``
  DATA frames without payload or END_STREAM, or empty trailers, in a row
  (Envoy: max_consecutive_inbound_frames_with_empty_payload, default 1).
  Empty CONTINUATION frames never reach us: h2's frame buffer fails the
  connection after 64 CONTINUATION frames (``h2.frame_buffer``).
- PRIORITY floods (CVE-2019-9513, the "resource loop"): at most
  ``max_priority_frames_per_stream`` per stream opened, plus one stream's
  worth (Envoy's rule).
- WINDOW_UPDATE floods: frames that ask for nothing but cost the server a
  wake-up of every blocked stream (a connection-level update) or a frame
  parse (an update for a closed stream, which h2 drops without an event).
  Envoy's rule (max_inbound_window_update_frames_per_data_frame_sent): at
  most ``max_window_updates_per_data_frame`` WINDOW_UPDATE frames, on the
  connection and on its streams together, per DATA frame we sent, plus one
  such allowance for the connection and one per stream opened (a client may
  widen each new stream's window at once). A reader that credits what it
  was sent, however slowly or in however small increments, stays far
  inside it; an update that unlocks nothing does not. A zero increment
  never reaches the budget: h2 (hyperframe) refuses it as a connection
  error (PROTOCOL_ERROR), on a stream as on the connection.
- 0-length header names (CVE-2019-9516): h2 rejects an empty name as a
  protocol error (GOAWAY PROTOCOL_ERROR); header lists, empty values included,
  are bounded by MAX_HEADER_LIST_SIZE (each field counts 32 bytes + its length).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hedgerow.decimal_text import parse_decimal

__all__ = ["H2Budget", "H2Limits", "RateBucket", "VERDICTS", "parse_h2_limits"]

# Every reason a connection can be cut for; the metric's label values.
VERDICTS = ("rapid_reset", "streams_per_read", "streams_per_s", "pings", "settings",
            "control_frames", "empty_frames", "priority", "window_updates", "error_resets")


@dataclass(frozen=True)
class H2Limits:
    """Per-connection HTTP/2 budgets; see the module docstring for the sources."""

    max_new_streams_per_read: int = 200  # nginx: 2 x http2_max_concurrent_streams (100 here)
    # A backstop above what one gateway process serves (~800 requests/s a core
    # on cache hits): the reset rules above do the work against Rapid Reset.
    new_streams_per_s: float = 2000.0
    new_streams_burst: int = 4000
    premature_reset_lifetime_s: float = 1.0  # Envoy's default
    premature_reset_window: int = 500  # Envoy's premature_reset_total_stream_count
    pings_per_s: float = 10.0
    pings_burst: int = 100
    settings_per_s: float = 10.0
    settings_burst: int = 100
    max_control_frames_per_read: int = 1000  # Envoy's max_outbound_control_frames
    max_consecutive_empty_frames: int = 1  # Envoy's default
    # PRIORITY frames: at most this many per stream opened, plus one stream's
    # worth (Envoy's max_inbound_priority_frames_per_stream). Each one for an
    # unknown stream adds a node to hypercorn's priority tree, and past 1000
    # nodes the tree raises inside hypercorn, killing the connection with a
    # traceback.
    max_priority_frames_per_stream: int = 100
    # WINDOW_UPDATE frames (connection and streams together) per DATA frame
    # sent, plus this many for the connection and for each stream opened
    # (Envoy's max_inbound_window_update_frames_per_data_frame_sent: 10).
    max_window_updates_per_data_frame: int = 10
    # RST_STREAM frames the client's protocol errors obliged us to send, in
    # the connection's life (hyper's h2: max_local_error_reset_streams, 1024;
    # lower here: a client that obeys the protocol causes ~none).
    max_error_resets: int = 100

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"H2Limits.{name} must be positive, got {value}")


def parse_h2_limits(items: Iterable[str], base: H2Limits = H2Limits()) -> H2Limits:
    """``NAME=VALUE`` overrides (``--h2-limit``) on ``base``; ValueError names a
    bad one. Counts are plain digits; rates may have a fraction."""
    fields = {f.name: f.type for f in dataclasses.fields(H2Limits)}
    changes: dict[str, Any] = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in fields:
            raise ValueError(f"unknown HTTP/2 limit {name!r} (known: {', '.join(fields)})")
        value: int | float | None
        if fields[name] in (int, "int"):
            value = parse_decimal(text)
        else:
            value = _parse_rate(text)
        if value is None:
            raise ValueError(f"HTTP/2 limit {name} needs a positive number, got {text!r}")
        changes[name] = value
    return dataclasses.replace(base, **changes)  # __post_init__ checks each value


def _parse_rate(text: str) -> float | None:
    whole, _, fraction = text.partition(".")
    if parse_decimal(whole, max_digits=9) is None or (fraction and parse_decimal(fraction) is None):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


class RateBucket:
    """A token bucket: ``burst`` at once, refilled at ``rate`` a second."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        """Spend one token; False when none is left."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class H2Budget:
    """One connection's spending; each call returns a verdict name or None."""

    def __init__(self, limits: H2Limits, now: float) -> None:
        self.limits = limits
        self.streams = RateBucket(limits.new_streams_per_s, limits.new_streams_burst, now)
        self.pings = RateBucket(limits.pings_per_s, limits.pings_burst, now)
        self.settings = RateBucket(limits.settings_per_s, limits.settings_burst, now)
        # Open streams' start times: bounded by MAX_CONCURRENT_STREAMS, which
        # h2 enforces; entries leave when the stream closes.
        self.opened_at: dict[int, float] = {}
        self.opened = 0
        self.closed = 0
        self.premature = 0
        self.priority_frames = 0
        self.window_updates = 0
        self.data_frames_sent = 0
        self.error_resets = 0
        self._streams_this_read = 0
        self._control_this_read = 0
        self._empty_in_a_row = 0

    def begin_read(self) -> None:
        """A new batch of bytes from the socket: per-read counters restart."""
        self._streams_this_read = 0
        self._control_this_read = 0

    def stream_opened(self, stream_id: int, now: float) -> str | None:
        self.opened_at[stream_id] = now
        self.opened += 1
        self._empty_in_a_row = 0
        self._streams_this_read += 1
        if self._streams_this_read > self.limits.max_new_streams_per_read:
            return "streams_per_read"
        return None if self.streams.take(now) else "streams_per_s"

    def stream_reset_by_client(self, stream_id: int, now: float) -> str | None:
        opened = self.opened_at.pop(stream_id, None)
        if opened is None:
            return None  # reset of a stream already closed: counted then
        self.closed += 1
        if now - opened < self.limits.premature_reset_lifetime_s:
            self.premature += 1
        return self._premature_verdict()

    def stream_closed(self, stream_id: int) -> None:
        """A stream ended any other way (answered, or reset by us)."""
        if self.opened_at.pop(stream_id, None) is not None:
            self.closed += 1

    def _premature_verdict(self) -> str | None:
        # Envoy's rule (ConnectionManagerImpl::maybeDrainDueToPrematureResets):
        # below the window, cut as soon as the premature resets alone would
        # make half of it; beyond, when they are half of all closed streams.
        window = self.limits.premature_reset_window
        if self.closed < window:
            return "rapid_reset" if self.premature * 2 >= window else None
        return "rapid_reset" if self.premature * 2 >= self.closed else None

    def ping(self, now: float) -> str | None:
        return self._control() or (None if self.pings.take(now) else "pings")

    def settings_frame(self, now: float) -> str | None:
        return self._control() or (None if self.settings.take(now) else "settings")

    def reset_sent(self) -> str | None:
        """We owe the client a RST_STREAM (e.g. a frame on a closed stream)."""
        return self._control()

    def _control(self) -> str | None:
        self._control_this_read += 1
        if self._control_this_read > self.limits.max_control_frames_per_read:
            return "control_frames"
        return None

    def priority_frame(self) -> str | None:
        self.priority_frames += 1
        allowed = self.limits.max_priority_frames_per_stream * (1 + self.opened)
        return "priority" if self.priority_frames > allowed else None

    def frame_payload(self, empty: bool) -> str | None:
        """A DATA frame (or trailers) arrived; ``empty``: no payload, no END_STREAM."""
        if not empty:
            self._empty_in_a_row = 0
            return None
        self._empty_in_a_row += 1
        if self._empty_in_a_row > self.limits.max_consecutive_empty_frames:
            return "empty_frames"
        return None

    def data_frame_sent(self) -> None:
        """We sent the client a DATA frame: it may credit it back."""
        self.data_frames_sent += 1

    def window_updates_received(self, count: int) -> str | None:
        """``count`` WINDOW_UPDATE frames arrived in one read (on the connection
        or any stream, open or closed; any increment h2 accepts). Charged after
        the read's new streams, which earn their own allowance."""
        self.window_updates += count
        earned = 1 + self.opened + self.data_frames_sent
        if self.window_updates > self.limits.max_window_updates_per_data_frame * earned:
            return "window_updates"
        return None

    def error_resets_sent(self, count: int) -> str | None:
        """h2 queued ``count`` RST_STREAM frames of its own while parsing one
        read: the client's frames broke the protocol on a stream."""
        self.error_resets += count
        return "error_resets" if self.error_resets > self.limits.max_error_resets else None
