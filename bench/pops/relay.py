"""The WAN between PoPs: a TCP relay that delays, jitters and "loses".

This kernel has no ``tc netem``, so WAN behaviour is made in user space. The
relay runs in the ``wan`` namespace (``bench.pops.netns``) and listens on the
service ports that cross PoPs; every connection from PoP *a* to an address of
PoP *b* lands on it. It reads the link *a→b* from the connection's two
addresses, connects onward, and pumps both directions through a ``DelayLine``:

- **delay**: each chunk is delivered one one-way delay (RTT/2) after it was
  read, plus a uniform jitter of ±``jitter_ms``/2;
- **order**: delivery times never go backwards within a direction, as TCP
  delivers in order (jitter cannot reorder bytes, it can only bunch them);
- **handshake**: the first client bytes arrive no sooner than one RTT plus one
  one-way delay after the connect, what the TCP handshake and the trip would
  have cost across the WAN (the relay accepts locally at once);
- **loss**: TCP never loses bytes, it resends them. A "lost" chunk (probability
  ``loss``) is delivered one retransmission timeout later (max(200 ms, 2×RTT),
  Linux's minimum RTO or a tail-loss probe) and holds back everything behind it
  (head-of-line blocking). That is the latency a real loss costs a TCP stream;
  throughput effects (congestion window cuts) are not modelled.

UDP is not relayed: nothing in the simulation sends UDP across PoPs (HTTP/3
ends at each PoP's gateway). Queues are bounded (``MAX_CHUNKS_IN_FLIGHT`` per
direction), so a slow reader back-pressures the sender as TCP would.

Run: ``python -m bench.pops.relay CONFIG.json`` (see ``RelayConfig``); it
prints ``ready`` once listening and per-link counters as JSON on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.pops.netns import pop_number_of

MAX_CHUNKS_IN_FLIGHT = 64
READ_SIZE = 65536
MIN_RTO_S = 0.2
IP_TRANSPARENT = getattr(socket, "IP_TRANSPARENT", 19)


@dataclass(frozen=True)
class LinkShape:
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0  # probability a chunk needs a retransmission

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"bad link shape {self}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000

    @property
    def retransmit_s(self) -> float:
        return max(MIN_RTO_S, 2 * self.rtt_ms / 1000)


class DelayLine:
    """Sans-IO: when each chunk read from one direction of one connection is delivered."""

    def __init__(self, shape: LinkShape, rng: random.Random, not_before: float = 0.0) -> None:
        self.shape = shape
        self.rng = rng
        self.last = not_before
        self.losses = 0

    def deliver_at(self, now: float) -> float:
        half_jitter = self.shape.jitter_ms / 2000
        delay = max(0.0, self.shape.one_way_s + self.rng.uniform(-half_jitter, half_jitter))
        if self.shape.loss and self.rng.random() < self.shape.loss:
            delay += self.shape.retransmit_s
            self.losses += 1
        self.last = max(self.last, now + delay)
        return self.last


@dataclass
class LinkStats:
    connections: int = 0
    chunks: int = 0
    losses: int = 0


@dataclass
class RelayConfig:
    """``ports``: where to listen. ``pops``: PoP number → name. ``links``:
    ``"ams>fra"`` → a ``LinkShape``; a pair without one is refused."""

    ports: list[int]
    pops: dict[int, str]
    links: dict[tuple[str, str], LinkShape]
    seed: int = 0
    stats: dict[str, LinkStats] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RelayConfig:
        links = {}
        for key, shape in data["links"].items():
            a, _, b = key.partition(">")
            links[(a, b)] = LinkShape(**shape)
        return cls(ports=[int(p) for p in data["ports"]],
                   pops={int(k): v for k, v in data["pops"].items()}, links=links,
                   seed=int(data.get("seed", 0)))

    def to_json(self) -> dict[str, Any]:
        return {"ports": self.ports, "pops": {str(k): v for k, v in self.pops.items()},
                "links": {f"{a}>{b}": vars(s) for (a, b), s in self.links.items()},
                "seed": self.seed}

    def link_of(self, source: str, destination: str) -> tuple[str, str] | None:
        a, b = pop_number_of(source), pop_number_of(destination)
        if a is None or b is None or a not in self.pops or b not in self.pops:
            return None
        pair = (self.pops[a], self.pops[b])
        return pair if pair in self.links else None


class Relay:
    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.connections: set[asyncio.Task[None]] = set()  # held: asyncio keeps weak refs

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            await self._relay(reader, writer)
        finally:
            self.connections.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        here, port = writer.get_extra_info("sockname")[:2]
        peer = writer.get_extra_info("peername")[0]
        link = self.config.link_of(peer, here)
        if link is None:
            writer.close()
            return
        shape = self.config.links[link]
        stats = self.config.stats.setdefault(f"{link[0]}>{link[1]}", LinkStats())
        stats.connections += 1
        accepted = loop.time()
        try:
            up_reader, up_writer = await asyncio.open_connection(here, port)
        except OSError:
            writer.close()
            return
        # Client bytes wait for the handshake a real WAN would have cost.
        handshake_done = accepted + shape.rtt_ms / 1000 + shape.one_way_s
        forward = DelayLine(shape, random.Random(self.rng.random()), handshake_done)
        backward = DelayLine(shape, random.Random(self.rng.random()))
        try:
            await asyncio.gather(_pump(reader, up_writer, forward, stats),
                                 _pump(up_reader, writer, backward, stats))
        finally:
            for w in (writer, up_writer):
                w.close()

    async def serve(self, stop: asyncio.Event) -> None:
        servers = [await asyncio.start_server(self.handle, sock=_transparent_listener(port))
                   for port in self.config.ports]
        print("ready", flush=True)
        await stop.wait()
        for server in servers:
            server.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)


def _transparent_listener(port: int) -> socket.socket:
    """A listener that may answer from addresses that are not its own.

    The ``wan`` namespace takes 10.77/16 as local only through a policy rule,
    so replies carry a source address no interface holds; without
    IP_TRANSPARENT (root) the kernel refuses to send them."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: DelayLine,
                stats: LinkStats) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_CHUNKS_IN_FLIGHT)

    async def read() -> None:
        while True:
            try:
                data = await reader.read(READ_SIZE)
            except ConnectionError:
                data = b""
            losses = line.losses
            await queue.put((line.deliver_at(loop.time()), data))
            stats.chunks += 1
            stats.losses += line.losses - losses
            if not data:
                return

    async def write() -> None:
        while True:
            at, data = await queue.get()
            await asyncio.sleep(max(0.0, at - loop.time()))
            if not data:
                if writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return
            writer.write(data)
            try:
                await writer.drain()
            except ConnectionError:
                return

    reading = asyncio.create_task(read())
    try:
        await write()
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


async def _main(config_path: Path) -> None:
    config = RelayConfig.from_json(json.loads(config_path.read_text()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await Relay(config).serve(stop)
    print(json.dumps({k: vars(v) for k, v in sorted(config.stats.items())}), flush=True)


if __name__ == "__main__":
    asyncio.run(_main(Path(sys.argv[1])))
