"""Who may open a QUIC connection, decided before any QUIC or TLS work (sans-IO).

An Initial packet for an unknown connection costs the server a TLS handshake
and a connection's state, and its source address is not yet proven: on the
open internet it can be spoofed. ``QuicFrontDoor.screen`` decides, from the
packet's addresses and token and an injected ``now``, one of:

- ``RETRY``: answer with a stateless Retry carrying a token (RFC 9000 8.1.2)
  and keep nothing. Sent when ``retry`` is ``always``, or (``auto``) while at
  least ``retry_above_half_open`` handshakes are pending. A spoofed source
  never sees the token, so it never gets further; a Retry is smaller than the
  padded Initial that asked for it, so it amplifies nothing.
- ``INVALID_TOKEN``: the token is not one of ours, is for another address, or
  expired: close at once (RFC 9000 8.1.3).
- ``DROP``: too many half-open (handshake not done) connections in all
  (``max_half_open``) or from this source (``max_half_open_per_source``; the
  source is the IPv4 address or the IPv6 /64), the client's IP or prefix is
  over its per-client limits (the cap's ``SourceLimits``, the very instance
  the TCP listener asks: open connections and new connections a second
  count TCP and QUIC together, so a client cannot double its share by using
  both), or the shared TCP+QUIC ``ConnectionCap`` is full. The client's
  handshake times out as for a lost packet.
- ``ADMIT``: open a connection (``open``: it takes its per-client slots and a
  slot of the cap), tracked as half-open until its handshake completes
  (``established``) or ``handshake_timeout_s`` passes (the caller closes it
  and reports ``closed``, which gives every slot back).

The per-client limits are asked after the Retry decision: when a Retry is
sent, only a client that came back with its token (a proven address) is
counted, so a spoofed flood cannot spend a real client's budget. Below the
auto-Retry threshold (or with ``retry`` ``never``) an Initial is admitted
unproven, and it is counted against the address it claims, as TCP counts
the address that completed its handshake.

Why ``max_half_open_per_source`` (32) is below ``retry_above_half_open``
(64): one source alone cannot switch Retry on for everyone (each new client
would pay a round trip for one noisy address); it takes at least two.
Above the threshold a source is both Retried and capped: the cap then
bounds what a source with a proven address can hold in handshakes.

Tokens are AES-GCM sealed (key per process, never stored), bound to the
client's IP and port and the connection ids of the exchange, and expire after
``token_lifetime_s``. The I/O (sending, timers, hypercorn) lives in
``gateway.edge.quic_cap``.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hedgerow.connection_cap import ConnectionCap
from hedgerow.source_limits import SourceLimits

Address = tuple[Any, ...]  # (host, port, ...) as asyncio reports a datagram's source

RETRY_MODES = ("auto", "always", "never")
_NONCE = 12
_CID_MAX = 20


@dataclass(frozen=True)
class QuicLimits:
    """The gateway's QUIC / HTTP/3 bounds (``hedgerow gateway --quic-*`` / ``--h3-*``)."""

    retry: str = "auto"
    retry_above_half_open: int = 64
    max_half_open: int = 512
    max_half_open_per_source: int = 32
    handshake_timeout_s: float = 5.0
    token_lifetime_s: float = 10.0
    # The HEADERS frame as sent and the field section once decoded (names +
    # values + 32 bytes a line, RFC 9114 4.2.2), like h2's header list limit.
    h3_max_field_section_bytes: int = 64 * 1024
    # Requests over it are answered 431, one stream each; past this many on
    # one connection (or over it in trailers) the connection is closed.
    h3_max_refused_header_sections: int = 8
    # 0: no QPACK dynamic table, so a small HEADERS frame cannot inflate into
    # a large field section by repeating references to big table entries.
    h3_qpack_table_bytes: int = 0
    h3_qpack_blocked_streams: int = 16
    # Flow-control windows: what one connection / one stream may have in
    # flight unread (aioquic's defaults are 1 MiB for both).
    max_data_bytes: int = 1024 * 1024
    max_stream_data_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if self.retry not in RETRY_MODES:
            raise ValueError(f"retry must be one of {RETRY_MODES}, not {self.retry!r}")
        for name in ("retry_above_half_open", "h3_qpack_table_bytes", "h3_qpack_blocked_streams"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("max_half_open", "max_half_open_per_source", "h3_max_field_section_bytes",
                     "h3_max_refused_header_sections", "max_data_bytes", "max_stream_data_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.handshake_timeout_s > 0 or not self.token_lifetime_s > 0:
            raise ValueError("handshake_timeout_s and token_lifetime_s must be positive")


class Verdict(Enum):
    ADMIT = "admit"
    RETRY = "retry"
    INVALID_TOKEN = "invalid_token"
    DROP = "drop"


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    # ADMIT: the ids aioquic's server connection is built with.
    original_destination_cid: bytes = b""
    retry_source_cid: bytes | None = None
    reason: str = ""


def source_key(address: Address) -> str:
    """The per-source unit: an IPv4 address, or the /64 an IPv6 one is in
    (one host commonly holds a whole /64)."""
    host = str(address[0])
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class RetryTokens:
    """Seal and open Retry tokens: address-bound, expiring, unforgeable."""

    def __init__(self, lifetime_s: float, key: bytes | None = None) -> None:
        self._aead = AESGCM(key or AESGCM.generate_key(bit_length=128))
        self._lifetime_s = lifetime_s

    def seal(self, address: Address, original_cid: bytes, retry_cid: bytes, now: float) -> bytes:
        body = (_address_bytes(address) + bytes([len(original_cid)]) + original_cid
                + bytes([len(retry_cid)]) + retry_cid + struct.pack("!d", now))
        nonce = os.urandom(_NONCE)
        return nonce + self._aead.encrypt(nonce, body, None)

    def open(self, token: bytes, address: Address, destination_cid: bytes,
             now: float) -> bytes | None:
        """The original destination id the token was issued for, or None when
        the token is forged, for another address or id, or expired."""
        if len(token) <= _NONCE:
            return None
        try:
            body = self._aead.decrypt(token[:_NONCE], token[_NONCE:], None)
        except InvalidTag:
            return None
        bound = _address_bytes(address)
        if not body.startswith(bound):
            return None
        rest = body[len(bound):]
        original, rest = _take(rest)
        retry_cid, rest = _take(rest)
        if original is None or retry_cid is None or len(rest) != 8:
            return None
        (issued,) = struct.unpack("!d", rest)
        # The client sends its next Initial to the Retry's source id (RFC 9000 17.2.5.2).
        if retry_cid != destination_cid or not 0 <= now - issued <= self._lifetime_s:
            return None
        return original


def _address_bytes(address: Address) -> bytes:
    host = str(address[0]).encode()
    return bytes([len(host)]) + host + struct.pack("!H", int(address[1]) & 0xFFFF)


def _take(data: bytes) -> tuple[bytes | None, bytes]:
    if not data or data[0] > _CID_MAX or len(data) < 1 + data[0]:
        return None, b""
    return data[1:1 + data[0]], data[1 + data[0]:]


class QuicFrontDoor:
    """Half-open and established QUIC connections of one gateway process."""

    def __init__(self, limits: QuicLimits, cap: ConnectionCap | None = None,
                 tokens: RetryTokens | None = None) -> None:
        self.limits = limits
        self.cap = cap
        self.tokens = tokens or RetryTokens(limits.token_lifetime_s)
        # handle -> (source, opened at); the per-client limits' address per
        # connection holding their slots (None: exempt, or no limits).
        self._half_open: dict[int, tuple[str, float]] = {}
        self._per_source: Counter[str] = Counter()
        self._established: set[int] = set()
        self._clients: dict[int, str | None] = {}
        self.refused: Counter[str] = Counter()  # by reason
        self.retries_sent = 0
        self.handshake_timeouts = 0
        self.h3_headers_refused = 0  # header sections over the limit (431 or cut)
        self.h3_connections_cut = 0  # of them, the ones that closed their connection

    @property
    def half_open(self) -> int:
        return len(self._half_open)

    @property
    def sources(self) -> SourceLimits | None:
        """The per-client limits, shared with the TCP listener (the cap's)."""
        return self.cap.sources if self.cap is not None else None

    def _limited(self, address: Address) -> str | None:
        """The address the per-client limits count, or None (none, or exempt)."""
        sources = self.sources
        host = str(address[0]) if address else ""
        if sources is None or not host or sources.exempt(host):
            return None
        return host

    def retry_required(self) -> bool:
        if self.limits.retry == "always":
            return True
        if self.limits.retry == "never":
            return False
        return len(self._half_open) >= self.limits.retry_above_half_open

    def screen(self, *, address: Address, destination_cid: bytes, token: bytes,
               now: float) -> Admission:
        """Decide on an Initial for an unknown connection (changes only counters)."""
        if len(self._half_open) >= self.limits.max_half_open:
            return self._refuse("half_open")
        retry_cid: bytes | None = None
        original = destination_cid
        if token:
            opened = self.tokens.open(token, address, destination_cid, now)
            if opened is None:
                self.refused["invalid_token"] += 1
                return Admission(Verdict.INVALID_TOKEN, reason="invalid_token")
            original, retry_cid = opened, destination_cid
        elif self.retry_required():
            self.retries_sent += 1
            return Admission(Verdict.RETRY, reason="retry")
        if self._per_source[source_key(address)] >= self.limits.max_half_open_per_source:
            return self._refuse("per_source")
        client = self._limited(address)
        if client is not None:
            assert self.sources is not None
            if self.sources.check(client, now) is not None:
                return self._refuse("per_client")
        if self.cap is not None and self.cap.open >= self.cap.limit:
            self.cap.refused += 1
            return self._refuse("connection_cap")
        return Admission(Verdict.ADMIT, original, retry_cid)

    def retry_token(self, address: Address, original_cid: bytes, retry_cid: bytes,
                    now: float) -> bytes:
        return self.tokens.seal(address, original_cid, retry_cid, now)

    def open(self, handle: int, address: Address, now: float) -> bool:
        """Take the client's slots and one of the cap for an admitted
        connection; False: none left (both are shared with TCP, which may
        have taken the last one since ``screen``)."""
        client = self._limited(address)
        if client is not None:
            assert self.sources is not None
            if self.sources.admit(client, now) is not None:
                self.refused["per_client"] += 1
                return False
        if self.cap is not None and not self.cap.try_open():
            if client is not None:
                assert self.sources is not None
                self.sources.release(client, now)
            self.refused["connection_cap"] += 1
            return False
        source = source_key(address)
        self._half_open[handle] = (source, now)
        self._per_source[source] += 1
        self._clients[handle] = client
        return True

    def is_half_open(self, handle: int) -> bool:
        return handle in self._half_open

    def tracks(self, handle: int) -> bool:
        return handle in self._half_open or handle in self._established

    def established(self, handle: int) -> None:
        if self._forget_half_open(handle):
            self._established.add(handle)

    def closed(self, handle: int, now: float, *, timed_out: bool = False) -> None:
        """The connection is gone: every slot it held is given back (once)."""
        known = self._forget_half_open(handle)
        if handle in self._established:
            self._established.discard(handle)
            known = True
        if not known:
            return
        if timed_out:
            self.handshake_timeouts += 1
        if self.cap is not None:
            self.cap.close()
        client = self._clients.pop(handle, None)
        if client is not None and self.sources is not None:
            self.sources.release(client, now)

    def stats(self) -> dict[str, Any]:
        return {
            "half_open": len(self._half_open),
            "established": len(self._established),
            "max_half_open": self.limits.max_half_open,
            "refused": dict(self.refused),
            "retries_sent": self.retries_sent,
            "handshake_timeouts": self.handshake_timeouts,
            "h3_headers_refused": self.h3_headers_refused,
            "h3_connections_cut": self.h3_connections_cut,
        }

    def _forget_half_open(self, handle: int) -> bool:
        entry = self._half_open.pop(handle, None)
        if entry is None:
            return False
        source = entry[0]
        self._per_source[source] -= 1
        if self._per_source[source] <= 0:
            del self._per_source[source]
        return True

    def _refuse(self, reason: str) -> Admission:
        self.refused[reason] += 1
        return Admission(Verdict.DROP, reason=reason)
