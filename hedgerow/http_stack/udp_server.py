"""Hypercorn's UDP server, with its datagrams screened, a queue that holds a
burst, and a transport that closes at shutdown.

Changes: ``hypercorn.asyncio.run.UDPServer`` (the name ``worker_serve``
builds each QUIC listener's protocol from; hypercorn 0.18.0) becomes
``ScreenedUDPServer``, a subclass of hypercorn's ``UDPServer`` that:

1. calls the ``screen`` hook given to ``install`` for every datagram before
   hypercorn's packet queue: the gateway's QUIC front door answers (Retry)
   or drops Initials it will not admit there, so a flood of them never takes
   the queue slots open connections need;
2. queues ``UDP_QUEUE_DATAGRAMS`` datagrams, not 10 (a burst of new clients,
   each Initial 1200+ bytes, lost most of its handshakes);
3. closes its datagram transport when ``run`` ends (hypercorn drops it and it
   never closes: pgjones/hypercorn#373), and nudges ``run`` while
   terminating, since ``run`` re-checks "terminated and idle" only after a
   datagram, and a closing connection turns idle on a timer, so a shutdown
   sat out the whole ``graceful_timeout``. Upstream:
   ``docs/upstream/udp-server-shutdown.patch``.

If the internals moved: ``PatchError`` at install when ``UDPServer`` lacks
``run``, ``datagram_received`` or ``protocol_queue`` is not an attribute its
``__init__`` sets (checked by ``tests/unit/test_http_stack_udp_server.py``
on a real listener), or ``hypercorn.asyncio.run`` no longer has ``UDPServer``.

Scope: process (the class is swapped for every QUIC listener); the screen
is a no-op where no QUIC front door is in force (``ACTIVE_QUIC_DOOR``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import hypercorn.asyncio.run
from hypercorn.asyncio.udp_server import UDPServer
from hypercorn.events import Closed

from hedgerow.http_stack.patch import replace, require

NAME = "udp_server"
# Datagrams waiting for the QUIC protocol (hypercorn: 10); at most about
# 256 x 1.5 KB. Initials to Retry or drop never wait here.
UDP_QUEUE_DATAGRAMS = 256
SHUTDOWN_NUDGE_INTERVAL_S = 0.05

Address = Any
# (protocol or None, data, address, send, now) -> queue it for hypercorn?
Screen = Callable[[Any, bytes, Address, Callable[[bytes, Address], None], float], bool]


def _admit_all(protocol: Any, data: bytes, address: Address,
               send: Callable[[bytes, Address], None], now: float) -> bool:
    return True


class ScreenedUDPServer(UDPServer):
    screen: Screen = staticmethod(_admit_all)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.protocol_queue = asyncio.Queue(UDP_QUEUE_DATAGRAMS)

    # asyncio's DatagramProtocol API (public, stable), not hypercorn's.
    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        protocol = getattr(self, "protocol", None)
        if self.transport is not None and not self.screen(
                protocol, data, addr, self.transport.sendto, self.loop.time()):
            return
        super().datagram_received(data, addr)

    async def run(self, *args: Any, **kwargs: Any) -> None:
        waker = self.loop.create_task(self._wake_when_terminated())
        try:
            await super().run(*args, **kwargs)
        finally:
            waker.cancel()
            if self.transport is not None:
                self.transport.close()

    async def _wake_when_terminated(self) -> None:
        # QuicProtocol ignores Closed events: each one only makes run() look again.
        await self.context.terminated.wait()
        while True:
            await self.protocol_queue.put(Closed())
            await asyncio.sleep(SHUTDOWN_NUDGE_INTERVAL_S)


def install(screen: Screen | None = None) -> None:
    """Idempotent: the first ``screen`` given stays."""
    require(UDPServer, "run", "datagram_received", "protocol_send", patch=NAME)
    if screen is not None and ScreenedUDPServer.screen is _admit_all:
        ScreenedUDPServer.screen = staticmethod(screen)
    replace(hypercorn.asyncio.run, "UDPServer", ScreenedUDPServer, patch=NAME)
