"""Connection limits of the control plane's listeners (their flags: ``hedgerow.cli_flags``).

The gateway's public port is bounded at accept, before any TLS byte, by a
total cap (``hedgerow.connection_cap``) behind per-client limits
(``hedgerow.source_limits``), and by a TLS handshake timeout. The control
plane serves two listeners that need the same (``hedgerow.serving`` applies
them, with the very same classes):

- the internal one (``--port``, mutual TLS): workers heartbeat on it every
  second and gateways hold their watch streams, so it is sized for a fleet;
- the join one (``--join-port``): reachable without a client certificate
  (it sells the first one), so anyone on the network can open connections
  and start handshakes there. Legitimate traffic is a joiner now and then:
  its limits are small.

Only per-IP limits here, no per-prefix ones: a fleet's hosts usually share one
/24, so a per-prefix limit would be a second fleet-wide cap. Loopback is exempt
by default, as on the gateway (the launcher, local health checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hedgerow.connection_cap import ConnectionCap
from hedgerow.source_limits import DEFAULT_EXEMPT, SourceLimits, SourceLimitsConfig


@dataclass(frozen=True)
class ListenerLimits:
    max_connections: int  # open at once, in all; beyond, closed at accept
    max_per_ip: int  # open at once from one client IP (0: off)
    new_per_ip: float  # new connections a second from one IP, burst BURST_S worth (0: off)
    handshake_timeout_s: float  # a TLS handshake not done within this is closed
    exempt: tuple[str, ...] = DEFAULT_EXEMPT  # networks (CIDR) the per-IP limits skip

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"the connection limit must be >= 1, not {self.max_connections!r}")
        if not (self.handshake_timeout_s > 0 and math.isfinite(self.handshake_timeout_s)):
            raise ValueError("the handshake timeout must be a positive number of seconds, "
                             f"not {self.handshake_timeout_s!r}")
        self.source_config()  # ValueError names a bad per-IP limit or exempt network

    def source_config(self) -> SourceLimitsConfig:
        return SourceLimitsConfig(max_open_per_ip=self.max_per_ip, max_open_per_prefix=0,
                                  rate_per_ip=self.new_per_ip, rate_per_prefix=0.0,
                                  exempt=self.exempt)

    def cap(self, flag_prefix: str = "") -> ConnectionCap:
        """A fresh cap with its per-IP limits; refusals are logged naming
        ``--{flag_prefix}max-connections`` and its siblings."""
        return ConnectionCap(self.max_connections, SourceLimits(self.source_config()),
                             flag_prefix=flag_prefix)


# Internal: a worker heartbeats every second, on a kept-alive connection (a
# new one at worst each second); a gateway holds a few (watch streams,
# heartbeats). 256 per IP is a host running many of them; 50/s per IP
# reconnects them all at once after a control-plane restart.
INTERNAL = ListenerLimits(max_connections=4096, max_per_ip=256, new_per_ip=50.0,
                          handshake_timeout_s=5.0)
# Join: one joiner makes a connection or two, once (renewals go to the
# internal port). 64 in all, 8 per IP, 5 new a second per IP (burst 10): a
# host starting several workers at once joins them all; one flooding IP holds
# 8 slots for at most the handshake timeout each, not the listener.
JOIN = ListenerLimits(max_connections=64, max_per_ip=8, new_per_ip=5.0,
                      handshake_timeout_s=5.0)
