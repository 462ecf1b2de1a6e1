"""Per-client limits on the public port, TCP and QUIC together (sans-IO).

The connection cap (``hedgerow.connection_cap``) bounds the gateway's open
connections in total, so one client alone can take all of them and every
other client is refused with it. These limits come first: for each accepted
connection, before any TLS byte, ``SourceLimits.admit(address, now)`` says
whether its source may have it, counting per IP address and per network
prefix (/24 for IPv4, /64 for IPv6: what one host or one customer usually
holds, and what a client that rotates its addresses stays inside):

- open connections (``max_open_per_ip``, ``max_open_per_prefix``);
- new connections per second, a token bucket each with a burst of
  ``BURST_S`` seconds' worth (``rate_per_ip``, ``rate_per_prefix``).

QUIC connections are counted by the same instance when the QUIC front door
admits them (``gateway.edge.quic_admission``: after the Retry, when one is sent),
and give their slots back when they close: one client's TCP and QUIC
connections share its limits.

0 switches a limit off. A connection admitted here holds its source's slots
until ``release(address)``; one refused holds nothing. Sources in ``exempt``
networks (by default loopback: local health checks, a reverse proxy or a load
generator on the same host, all of whose clients would look like one IP) are
neither limited nor tracked.

Memory is bounded. A source with connections open is held in ``_open`` —
there are at most two such entries (IP, prefix) per open connection, and the
connection cap bounds those. A source with none open keeps only its rate
bucket, in an LRU table of at most ``max_idle_sources`` entries; the least
recently seen is forgotten first, and a bucket that has refilled completely
is forgotten at once (a full bucket is what a new source gets anyway).
Forgetting a partly drained bucket lets that source start again with a full
one; with the default table that takes 65,536 other sources in between.

Time is always a parameter (monotonic seconds); nothing here reads a clock.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from policies.token_bucket import TokenBucket

# Defaults: generous for one host (a browser opens ~6 connections; an office
# behind one NAT address, hundreds), tight enough that one source cannot take
# the whole --max-connections (4096) or hold the accept loop.
DEFAULT_MAX_OPEN_PER_IP = 256
DEFAULT_MAX_OPEN_PER_PREFIX = 1024
DEFAULT_RATE_PER_IP = 50.0
DEFAULT_RATE_PER_PREFIX = 200.0
DEFAULT_MAX_IDLE_SOURCES = 65_536
DEFAULT_EXEMPT = ("127.0.0.0/8", "::1/128")
# A bucket holds this many seconds of its rate: a page load's burst of
# connections passes, a sustained flood does not.
BURST_S = 2.0
IPV4_PREFIX = 24
IPV6_PREFIX = 64

Refusal = Literal["ip_open", "prefix_open", "ip_rate", "prefix_rate"]
REFUSALS: tuple[Refusal, ...] = ("ip_open", "prefix_open", "ip_rate", "prefix_rate")
Key = tuple[str, str]  # ("ip", "192.0.2.7") or ("net", "192.0.2.0/24")


@dataclass(frozen=True)
class SourceLimitsConfig:
    max_open_per_ip: int = DEFAULT_MAX_OPEN_PER_IP
    max_open_per_prefix: int = DEFAULT_MAX_OPEN_PER_PREFIX
    rate_per_ip: float = DEFAULT_RATE_PER_IP
    rate_per_prefix: float = DEFAULT_RATE_PER_PREFIX
    max_idle_sources: int = DEFAULT_MAX_IDLE_SOURCES
    exempt: tuple[str, ...] = DEFAULT_EXEMPT  # networks (CIDR) never limited

    def __post_init__(self) -> None:
        for network in self.exempt:
            ipaddress.ip_network(network, strict=False)  # ValueError names a bad one
        for name in ("max_open_per_ip", "max_open_per_prefix", "rate_per_ip",
                     "rate_per_prefix"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0 (0: off), not {value!r}")
        if self.max_idle_sources < 1:
            raise ValueError(f"max_idle_sources must be >= 1, not {self.max_idle_sources!r}")


class _Source:
    """One IP or prefix: its open connections and its rate bucket (None: no rate limit)."""

    __slots__ = ("open", "bucket")

    def __init__(self, rate: float) -> None:
        self.open = 0
        self.bucket = TokenBucket(rate, max(1.0, rate * BURST_S)) if rate > 0 else None


IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _parse(address: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 scope id
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def source_keys(address: str) -> tuple[Key, Key]:
    """The IP (IPv4-mapped IPv6 as IPv4) and its prefix, as table keys.

    An address that does not parse (a Unix socket's path, say) is one source
    of its own, in a prefix of its own."""
    ip = _parse(address)
    if ip is None:
        return ("ip", address), ("net", address)
    bits = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    network = ipaddress.ip_network((ip, bits), strict=False)
    return ("ip", str(ip)), ("net", str(network))


class SourceLimits:
    """Decides, per accepted connection, whether its source may open it."""

    def __init__(self, config: SourceLimitsConfig = SourceLimitsConfig()) -> None:
        self.config = config
        self._open: dict[Key, _Source] = {}
        self._idle: OrderedDict[Key, _Source] = OrderedDict()
        self.refused: dict[Refusal, int] = dict.fromkeys(REFUSALS, 0)
        self.forgotten = 0  # idle sources dropped from the full table (LRU)
        self._exempt = [ipaddress.ip_network(n, strict=False) for n in config.exempt]

    def exempt(self, address: str) -> bool:
        """Whether ``address`` is in an exempt network (then it is never limited)."""
        ip = _parse(address)
        return ip is not None and any(ip.version == n.version and ip in n
                                      for n in self._exempt)

    def check(self, address: str, now: float) -> Refusal | None:
        """What ``admit`` would answer now, taking nothing; a refusal is
        counted (the QUIC front door drops the packet on it)."""
        ip_key, net_key = source_keys(address)
        refusal = self._refusal(self._peek(ip_key), self._peek(net_key), now)
        if refusal is not None:
            self.refused[refusal] += 1
        return refusal

    def _peek(self, key: Key) -> _Source | None:
        return self._open.get(key) or self._idle.get(key)

    def _refusal(self, ip: _Source | None, net: _Source | None, now: float) -> Refusal | None:
        """Which limit a new connection would break (None: a source never
        seen, or forgotten, starts with no connection and a full bucket)."""
        config = self.config
        if ip is not None and config.max_open_per_ip and ip.open >= config.max_open_per_ip:
            return "ip_open"
        if (net is not None and config.max_open_per_prefix
                and net.open >= config.max_open_per_prefix):
            return "prefix_open"
        if ip is not None and ip.bucket is not None and ip.bucket.level(now) < 1.0:
            return "ip_rate"
        if net is not None and net.bucket is not None and net.bucket.level(now) < 1.0:
            return "prefix_rate"
        return None

    def admit(self, address: str, now: float) -> Refusal | None:
        """Take the source's slots for one new connection: None; or why not (counted).
        The caller gives them back with ``release`` -- except for an ``exempt``
        source, which holds none (check it first)."""
        ip_key, net_key = source_keys(address)
        ip, net = self._get(ip_key, now), self._get(net_key, now)
        refusal = self._refusal(ip, net, now)
        if refusal is not None:
            self.refused[refusal] += 1
            self._put_back(ip_key, ip, now)
            self._put_back(net_key, net, now)
            return refusal
        for key, source in ((ip_key, ip), (net_key, net)):
            if source.bucket is not None:
                source.bucket.try_take(1.0, now)
            source.open += 1
            self._open[key] = source
        return None

    def release(self, address: str, now: float) -> None:
        """One connection ``admit`` let in has closed."""
        for key in source_keys(address):
            source = self._open.get(key)
            if source is None:
                raise RuntimeError(f"a connection closed that was never admitted: {key}")
            source.open -= 1
            if source.open == 0:
                del self._open[key]
                self._put_back(key, source, now)

    def _get(self, key: Key, now: float) -> _Source:
        source = self._open.get(key)
        if source is None:
            source = self._idle.pop(key, None)
        if source is None:
            rate = self.config.rate_per_ip if key[0] == "ip" else self.config.rate_per_prefix
            source = _Source(rate)
        return source

    def _put_back(self, key: Key, source: _Source, now: float) -> None:
        """File a source that may have no connection open (again)."""
        if source.open > 0:
            return  # still in ``_open``
        bucket = source.bucket
        if bucket is None or bucket.level(now) >= bucket.burst:
            return  # nothing to remember: a new source starts the same
        self._idle[key] = source
        self._idle.move_to_end(key)
        while len(self._idle) > self.config.max_idle_sources:
            self._idle.popitem(last=False)
            self.forgotten += 1

    def stats(self) -> dict[str, Any]:
        return {"open_sources": len(self._open), "idle_sources": len(self._idle),
                "refused": dict(self.refused), "forgotten": self.forgotten}
