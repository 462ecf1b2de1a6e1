"""Flood drivers shared by the attack tests (``tests/faults/test_attack_*.py``)
and the ``attacks`` benchmark (``bench.attacks``): plain sockets on loopback,
bounded in count and time.

- ``quic_initial_flood``: real QUIC Initials (aioquic's packet builder), each
  from its own source port, paced; answers are read and classified (Retry or
  not) but never acted on.
- ``quic_connection_flood``: real QUIC handshakes (aioquic's client state
  machine, driven over plain UDP sockets) from one source address, each
  completed connection then held open without a request.
- ``connection_flood``: TCP connections from one source address, held open
  without ever starting TLS (or dropped at once); notes when the gateway cuts
  each one.
"""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import HandshakeCompleted

# -- QUIC Initial flood ----------------------------------------------------------------


def quic_client_configuration(ca_cert: Path) -> QuicConfiguration:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                      server_name="127.0.0.1", idle_timeout=10.0)
    configuration.load_verify_locations(cafile=str(ca_cert))
    return configuration


def quic_initial(port: int, ca_cert: Path) -> bytes:
    """The first datagram of a real client handshake to 127.0.0.1:``port``."""
    quic = QuicConnection(configuration=quic_client_configuration(ca_cert))
    quic.connect(("127.0.0.1", port), now=time.monotonic())
    (datagram, _), *_ = quic.datagrams_to_send(now=time.monotonic())
    return datagram


def is_retry(datagram: bytes) -> bool:
    return bool(datagram[0] & 0x80) and (datagram[0] & 0x30) >> 4 == 3  # QUIC v1 Retry


@dataclass
class QuicFloodResult:
    sent: int = 0
    sent_bytes: int = 0
    answers: int = 0
    answer_bytes: int = 0
    retries: int = 0
    first_retry_after_s: float | None = None  # from the first Initial sent
    # Source ports the gateway answered with anything but a Retry (it began a
    # handshake for them, and so held state): seconds from the first Initial
    # to that first answer.
    handshakes: dict[int, float] = field(default_factory=dict)


def quic_initial_flood(port: int, ca_cert: Path, duration_s: float, *, sockets: int,
                       pps: float) -> QuicFloodResult:
    """Initials from ``sockets`` source ports in turn, at most ``pps`` a second on
    average, for ``duration_s`` from the first one sent. (Building the Initials
    comes first and takes seconds on a loaded machine: a deadline fixed before
    it once left no time to send any.)"""
    target = ("127.0.0.1", port)
    initials = [quic_initial(port, ca_cert) for _ in range(sockets)]
    socks: list[socket.socket] = []
    result = QuicFloodResult()
    try:
        for _ in range(sockets):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
        started = time.monotonic()
        stop_at = started + duration_s
        while time.monotonic() < stop_at:
            for index, (sock, initial) in enumerate(zip(socks, initials)):
                while result.sent > (time.monotonic() - started) * pps:  # paced
                    time.sleep(0.001)
                sock.sendto(initial, target)
                result.sent += 1
                result.sent_bytes += len(initial)
                _drain(sock, index, result, started)
                if time.monotonic() >= stop_at:
                    break
        for index, sock in enumerate(socks):
            _drain(sock, index, result, started)
    finally:
        for sock in socks:
            sock.close()
    return result


def _drain(sock: socket.socket, index: int, result: QuicFloodResult, started: float) -> None:
    while True:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        result.answers += 1
        result.answer_bytes += len(data)
        if is_retry(data):
            result.retries += 1
            if result.first_retry_after_s is None:
                result.first_retry_after_s = time.monotonic() - started
        elif index not in result.handshakes:
            result.handshakes[index] = time.monotonic() - started


# -- QUIC connections from one IP, completed and held ------------------------------------


@dataclass
class QuicHold:
    """QUIC connections from one source: the ones whose handshake completed are
    held (nothing sent on them) until ``close``."""

    target: tuple[str, int]
    sockets: list[socket.socket] = field(default_factory=list)
    connections: list[QuicConnection] = field(default_factory=list)
    established: set[int] = field(default_factory=set)
    sent: int = 0  # datagrams, retransmissions included

    def close(self) -> None:
        """Close the held connections (CONNECTION_CLOSE) and every socket."""
        now = time.monotonic()
        for index in self.established:
            quic = self.connections[index]
            quic.close()
            for datagram, _ in quic.datagrams_to_send(now=now):
                try:
                    self.sockets[index].sendto(datagram, self.target)
                except OSError:
                    pass  # the server learns it from its idle timeout instead
        for sock in self.sockets:
            sock.close()


def quic_connection_flood(port: int, ca_cert: Path, *, source: str, count: int,
                          handshake_s: float) -> QuicHold:
    """Start ``count`` QUIC handshakes from ``source`` at once and drive them
    (retransmitting as aioquic's timers say) for ``handshake_s``; the caller
    closes what it returns."""
    hold = QuicHold(target=("127.0.0.1", port))
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            hold.sockets.append(sock)
            sock.bind((source, 0))
            sock.setblocking(False)
            quic = QuicConnection(configuration=quic_client_configuration(ca_cert))
            quic.connect(hold.target, now=time.monotonic())
            hold.connections.append(quic)
        deadline = time.monotonic() + handshake_s
        with selectors.DefaultSelector() as selector:
            for index, sock in enumerate(hold.sockets):
                selector.register(sock, selectors.EVENT_READ, index)
            while time.monotonic() < deadline and len(hold.established) < count:
                _drive(hold)
                for key, _ in selector.select(0.01):
                    _receive(hold, key.data)
            _drive(hold)  # the last Finished: the server completes its side too
    except BaseException:
        hold.close()
        raise
    return hold


def _drive(hold: QuicHold) -> None:
    now = time.monotonic()
    for index, quic in enumerate(hold.connections):
        timer = quic.get_timer()
        if timer is not None and timer <= now:
            quic.handle_timer(now=now)
        for datagram, _ in quic.datagrams_to_send(now=now):
            hold.sockets[index].sendto(datagram, hold.target)
            hold.sent += 1


def _receive(hold: QuicHold, index: int) -> None:
    sock, quic = hold.sockets[index], hold.connections[index]
    while True:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            break
        quic.receive_datagram(data, hold.target, now=time.monotonic())
    while (event := quic.next_event()) is not None:
        if isinstance(event, HandshakeCompleted):
            hold.established.add(index)


# -- TCP connection flood from one IP ---------------------------------------------------


@dataclass
class ConnectionFlood:
    """What a connection flood saw: seconds each cut connection lived, the ones
    still open at the end."""

    hold: bool
    cut_after: list[float] = field(default_factory=list)
    still_open: int = 0
    opened: int = 0
    errors: list[str] = field(default_factory=list)


def connection_flood(port: int, flood: ConnectionFlood, *, source: str, duration_s: float,
                     every_s: float, max_count: int, cut_wait_s: float) -> None:
    """Open connections from ``source`` to 127.0.0.1:``port`` for ``duration_s``
    or ``max_count`` connections; held ones are watched until they are cut, and
    for ``cut_wait_s`` after the last is opened."""
    opened_at: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as selector:

        def harvest(timeout: float) -> None:
            for key, _ in selector.select(timeout):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(1):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                flood.cut_after.append(time.monotonic() - opened_at.pop(sock))
                selector.unregister(sock)
                sock.close()

        started = time.monotonic()
        try:
            while time.monotonic() - started < duration_s and flood.opened < max_count:
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=2,
                                                    source_address=(source, 0))
                except OSError as error:  # the accept queue full, say: the flood goes on
                    flood.errors.append(repr(error))
                    continue
                flood.opened += 1
                if not flood.hold:
                    sock.close()
                    continue
                sock.setblocking(False)
                opened_at[sock] = time.monotonic()
                selector.register(sock, selectors.EVENT_READ)
                harvest(every_s)
            harvest(cut_wait_s)  # the last ones' closes, within their budget
            flood.still_open = len(opened_at)
        finally:
            for sock in opened_at:
                sock.close()
