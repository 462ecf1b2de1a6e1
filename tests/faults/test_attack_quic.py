"""Attacks on the QUIC / HTTP/3 front door, against a real gateway process.

Each test runs an attack from real sockets on loopback and, on other
connections at the same time, a well-behaved HTTP/3 client that opens a fresh
QUIC connection per request (so every one of its requests also goes through
the front door, Retry included). Each asserts that the abuse is cut or
contained within a stated budget AND that the good client's requests all
succeed with bounded latency, measured while the attack runs.

- An Initial flood from many source ports: the gateway Retries all but the
  first few (no state kept for them), those few half-open connections are
  closed by the handshake timeout, and nothing it sends back is larger than
  what it was sent (no amplification).
- Stalled handshakes from several 127.0.0.x sources that do answer the Retry
  (a proven address) and then stop: each source holds at most its
  per-source share of half-open connections, and they are closed by the
  handshake timeout.
- Oversized HTTP/3 header blocks (a complete one, and one that only
  declares a huge size): the request is answered 431 on its own stream as
  soon as the frame header arrives, and the same connection serves the next
  request; a connection that keeps sending them is closed with
  H3_EXCESSIVE_LOAD.
- A Version Negotiation packet is not answered (no reflection loop).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from aioquic.asyncio import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode, FrameType, H3Connection
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.quic_admission import QuicLimits
from bench.floods import (QuicFloodResult, is_retry, quic_client_configuration,
                          quic_initial_flood)
from tests.support.capped import start_capped_stack
from tests.support.h3client import h3_request
from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

CAP = 512
RETRY_ABOVE = 8
MAX_HALF_OPEN = 100
PER_SOURCE = 12
HANDSHAKE_TIMEOUT_S = 2.0
MAX_FIELD_SECTION = 16 * 1024
FLAGS = ("--quic-retry-above", str(RETRY_ABOVE), "--quic-max-half-open", str(MAX_HALF_OPEN),
         "--quic-max-half-open-per-source", str(PER_SOURCE),
         "--quic-handshake-timeout-s", str(HANDSHAKE_TIMEOUT_S),
         "--h3-max-field-section-bytes", str(MAX_FIELD_SECTION))

# The attack's bounds (count and time) and the budgets asserted.
FLOOD_SOCKETS = 300
FLOOD_S = 4.0
FLOOD_PPS = 3000
STALL_SOURCES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
STALL_PER_SOURCE = 30
STALL_GIVE_UP_S = 10.0  # a sanity bound: the gateway never Retried them all
# Half-open connections are gone this long after the attack stops: the
# handshake timeout plus scrape and scheduling slack.
CUT_BUDGET_S = HANDSHAKE_TIMEOUT_S + 2.0
# The good client: every request answered (each must within GOOD_MAX_BUDGET_S,
# its timeout); p95 latency of a fresh connection plus one request (Retry
# round trip included) under GOOD_P95_BUDGET_S. Unloaded ~0.1 s; on the
# shared 2-core test machine at load average 5-10 up to ~1 s (the 1 s budget
# this had flaked there). A gateway that the flood starved -- one holding a
# handshake per flood port, or refusing the good client's for want of room
# -- fails its requests outright (timeout) rather than slowing them.
GOOD_P95_BUDGET_S = 2.0
GOOD_MAX_BUDGET_S = 3.0
GOOD_INTERVAL_S = 0.05
# The good client's process makes this many requests before the attack, as
# a reference; a sanity bound on its start.
GOOD_LEAD_REQUESTS = 3
GOOD_START_S = 60.0
# An oversized header block is answered (431), or a connection that repeats
# them is closed, within this.
HEADER_CUT_BUDGET_S = 1.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_capped_stack(tmp_path_factory.mktemp("quic-attack"), CAP, *FLAGS)
    try:
        yield stack
    finally:
        stack.stop_all()


def _port(stack: Stack) -> int:
    return int(stack.gateway_url.rsplit(":", 1)[1])


def _client_configuration(stack: Stack) -> QuicConfiguration:
    return quic_client_configuration(stack.ca_cert)


def _metrics(stack: Stack) -> dict[str, float]:
    text = stack.gateway_metrics()
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("hedgerow_quic", "hedgerow_h3", "hedgerow_connections")):
                reason = sample.labels.get("reason")
                seen[f"{sample.name}{{{reason}}}" if reason else sample.name] = sample.value
    return seen


async def _scrape(stack: Stack) -> dict[str, float]:
    return await anyio.to_thread.run_sync(_metrics, stack)


async def _until(stack: Stack, predicate: Callable[[dict[str, float]], bool],
                 timeout_s: float) -> tuple[dict[str, float], float]:
    started = time.monotonic()
    with anyio.fail_after(timeout_s):
        while True:
            seen = await _scrape(stack)
            if predicate(seen):
                return seen, time.monotonic() - started
            await anyio.sleep(0.1)


@dataclass
class GoodClient:
    """Fresh-connection HTTP/3 requests in a loop, until ``stop`` is set."""

    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    async def run(self, port: int, cafile: Path, stop: Any, done: Any) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                response = await h3_request("127.0.0.1", port, path="/healthz",
                                            cafile=cafile, timeout_s=GOOD_MAX_BUDGET_S,
                                            ticket_wait_s=0)
                if response.status != 200:
                    self.failures.append(f"status {response.status}")
            except Exception as error:  # noqa: BLE001 - every failure is reported
                self.failures.append(repr(error))
            self.latencies.append(time.monotonic() - started)
            done.value += 1  # only this process writes it
            await asyncio.sleep(GOOD_INTERVAL_S)

    def summary(self) -> str:
        ordered = sorted(self.latencies)
        p50 = statistics.median(ordered)
        p95 = (statistics.quantiles(ordered, n=20, method="inclusive")[-1]
               if len(ordered) > 1 else ordered[0])
        return (f"good client: {len(ordered)} requests, p50 {p50 * 1000:.0f} ms, "
                f"p95 {p95 * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms")

    def check(self, minimum: int) -> None:
        print(self.summary())
        assert not self.failures, self.failures
        assert len(self.latencies) >= minimum, self.latencies
        p95 = statistics.quantiles(self.latencies, n=20, method="inclusive")[-1]
        assert p95 <= GOOD_P95_BUDGET_S, (p95, sorted(self.latencies)[-5:])
        assert max(self.latencies) <= GOOD_MAX_BUDGET_S, max(self.latencies)


def _good_client_process(port: int, cafile: str, stop: Any, done: Any, out: Any) -> None:
    good = GoodClient()
    try:
        asyncio.run(good.run(port, Path(cafile), stop, done))
    finally:
        out.send(good)


async def _during(stack: Stack, attack: Callable[[], Awaitable[Any]]) -> tuple[Any, GoodClient]:
    """Run ``attack`` with a good client beside it, from before it starts to
    its end. The good client runs in a process of its own: in this one it
    shared the GIL with the attack's threads (building and answering QUIC
    handshakes in Python), and at load average 5-10 its p95 measured that
    contention (1.6 s once), not the gateway."""
    context = multiprocessing.get_context("spawn")  # no fork of a threaded process
    stop = context.Event()
    done = context.Value("i", 0, lock=False)
    results, sender = context.Pipe(duplex=False)
    process = context.Process(target=_good_client_process, daemon=True,
                              args=(_port(stack), str(stack.ca_cert), stop, done, sender))
    process.start()
    try:
        # A few requests before, as a reference (its start imports aioquic:
        # seconds on a loaded machine).
        until = time.monotonic() + GOOD_START_S
        while done.value < GOOD_LEAD_REQUESTS and process.is_alive() and time.monotonic() < until:
            await anyio.sleep(0.05)
        result = await attack()
    finally:
        stop.set()
        ready = await anyio.to_thread.run_sync(results.poll, 60)
        good = results.recv() if ready else GoodClient(failures=["never reported"])
        await anyio.to_thread.run_sync(process.join, 15)
        if process.is_alive():
            process.kill()
    return result, good


def _flood(stack: Stack, done: threading.Event) -> QuicFloodResult:
    try:
        return quic_initial_flood(_port(stack), stack.ca_cert, FLOOD_S, sockets=FLOOD_SOCKETS,
                                  pps=FLOOD_PPS)
    finally:
        done.set()


async def test_an_initial_flood_from_many_ports_is_retried_and_cut(stack: Stack) -> None:
    before = await _scrape(stack)
    peak: list[float] = []

    async def attack() -> QuicFloodResult:
        done = threading.Event()
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while not done.is_set():
                    peak.append((await _scrape(stack))["hedgerow_quic_half_open"])
                    await anyio.sleep(0.2)
            group.start_soon(watch)
            return await anyio.to_thread.run_sync(_flood, stack, done)

    flood, good = await _during(stack, attack)
    after, took = await _until(stack, lambda m: m["hedgerow_quic_half_open"] == 0, CUT_BUDGET_S)

    retries = after["hedgerow_quic_retries_total"] - before["hedgerow_quic_retries_total"]
    timeouts = (after["hedgerow_quic_handshake_timeouts_total"]
                - before["hedgerow_quic_handshake_timeouts_total"])
    print(f"flood: {flood}, gateway retries {retries:.0f}, peak half-open {max(peak)}, "
          f"timeouts {timeouts:.0f}, half-open gone {took:.1f} s after")
    assert flood.sent >= FLOOD_PPS * FLOOD_S / 2, flood  # the attack really ran
    # Every Initial the gateway read was answered statelessly except those of
    # the ports it began a handshake for (below the Retry threshold, and
    # again each time the handshake timeout emptied it): each port resends
    # its one Initial every round, and once its connection exists those are
    # its packets, not new Initials. Plus one round in flight. (What it did
    # not read -- the kernel drops datagrams past the socket's buffer when a
    # loaded machine falls behind 3,000/s -- got no answer at all.)
    per_port = -(-flood.sent // FLOOD_SOCKETS)
    unretried = len(flood.handshakes) * per_port + FLOOD_SOCKETS
    assert flood.retries >= flood.answers - unretried, (unretried, flood)
    # And the flood went far past the Retry threshold: at least one Retry per
    # port. (Not a share of what was sent: a loaded machine's gateway reads
    # fewer than 3,000 datagrams a second, and the kernel drops the rest.)
    assert retries >= flood.retries >= FLOOD_SOCKETS, (retries, flood)
    # Half-open connections never went past the Retry threshold (plus the good
    # client's own, which come with a token), and each flood one timed out.
    assert peak and max(peak) <= RETRY_ABOVE + 2, peak
    assert timeouts >= 1
    # No amplification: the flood got back fewer bytes than it sent.
    assert flood.answer_bytes < flood.sent_bytes, flood
    good.check(minimum=10)


def _stall(stack: Stack, source: str, count: int) -> tuple[list[socket.socket], int]:
    """``count`` handshakes from ``source`` that answer the Retry with its token
    (so their address is proven) and then never send anything again, all
    within a fraction of the handshake timeout. Returns the sockets (held
    open: the caller closes them) and how many the gateway started a
    handshake for (answered with anything but a Retry)."""
    target = ("127.0.0.1", _port(stack))
    socks: list[socket.socket] = []
    quics: list[QuicConnection] = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        socks.append(sock)
        sock.bind((source, 0))
        sock.setblocking(False)
        quic = QuicConnection(configuration=_client_configuration(stack))
        quic.connect(target, now=time.monotonic())
        quics.append(quic)
    for sock, quic in zip(socks, quics):
        for datagram, _ in quic.datagrams_to_send(now=time.monotonic()):
            sock.sendto(datagram, target)
    handshaking: set[int] = set()
    retried: set[int] = set()
    # Until the gateway's answers settle. Not a fixed window from the start: at
    # load average 8-10 the gateway took more than the 1 s this once was to
    # Retry 120 Initials and begin 48 handshakes, and the count came up
    # short. Nothing is ever re-sent (no timers run here), so waiting longer
    # cannot admit more than the cap would.
    give_up = time.monotonic() + STALL_GIVE_UP_S
    settled = time.monotonic() + HANDSHAKE_TIMEOUT_S / 2
    while time.monotonic() < min(settled, give_up):
        for index, (sock, quic) in enumerate(zip(socks, quics)):
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            if not is_retry(data):
                news = index not in handshaking
                handshaking.add(index)  # admitted (with a token, or under the threshold)
            else:
                news = index not in retried
            if news and is_retry(data):
                retried.add(index)  # answer it once, with the token, then go quiet
                quic.receive_datagram(data, target, now=time.monotonic())
                for datagram, _ in quic.datagrams_to_send(now=time.monotonic()):
                    sock.sendto(datagram, target)
            if news:
                # Settled as long as the whole window this once was after the
                # last new answer (the gateway's resends of its handshake
                # flight are not news; a datagram the kernel dropped is never
                # answered, so "every port answered" may never come).
                settled = time.monotonic() + HANDSHAKE_TIMEOUT_S / 2
        time.sleep(0.005)
    return socks, len(handshaking)


async def test_stalled_handshakes_are_capped_per_source_and_time_out(stack: Stack) -> None:
    before = await _scrape(stack)
    held: list[socket.socket] = []
    seen_half_open: list[float] = []

    async def attack() -> list[int]:
        answered = []
        lock = threading.Lock()

        def one(source: str) -> None:
            socks, got = _stall(stack, source, STALL_PER_SOURCE)
            with lock:
                held.extend(socks)
                answered.append(got)

        async with anyio.create_task_group() as group:
            for source in STALL_SOURCES:
                group.start_soon(anyio.to_thread.run_sync, one, source)
        seen_half_open.append((await _scrape(stack))["hedgerow_quic_half_open"])
        # The good client goes on while the stalled handshakes are held.
        await anyio.sleep(HANDSHAKE_TIMEOUT_S)
        return answered

    try:
        answered, good = await _during(stack, attack)
        after, took = await _until(stack, lambda m: m["hedgerow_quic_half_open"] == 0,
                                   CUT_BUDGET_S)
    finally:
        for sock in held:
            sock.close()
    refused = (after["hedgerow_quic_refused_total{per_source}"]
               - before.get("hedgerow_quic_refused_total{per_source}", 0))
    print(f"stall: handshakes started per source {answered}, half-open {seen_half_open}, "
          f"per-source refusals {refused:.0f}, gone {took:.1f} s after")
    # Each source got at most its share of half-open connections (and did
    # reach it); the token-bearing Initials beyond it were dropped.
    assert all(got <= PER_SOURCE for got in answered), answered
    assert sum(answered) >= len(STALL_SOURCES) * PER_SOURCE / 2, answered
    assert refused >= len(STALL_SOURCES) * (STALL_PER_SOURCE - PER_SOURCE) // 2, refused
    assert seen_half_open[0] <= len(STALL_SOURCES) * PER_SOURCE + 2, seen_half_open
    timeouts = (after["hedgerow_quic_handshake_timeouts_total"]
                - before["hedgerow_quic_handshake_timeouts_total"])
    assert timeouts >= len(STALL_SOURCES) * PER_SOURCE / 2, timeouts
    good.check(minimum=5)


class _Recorder(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.terminated: asyncio.Future[ConnectionTerminated] = (
            asyncio.get_running_loop().create_future())
        self.statuses: dict[int, asyncio.Future[int]] = {}

    def status(self, stream_id: int) -> asyncio.Future[int]:
        return self.statuses.setdefault(stream_id, asyncio.get_running_loop().create_future())

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated) and not self.terminated.done():
            self.terminated.set_result(event)
        for h3_event in self.h3.handle_event(event):
            headers = getattr(h3_event, "headers", None)
            stream_id = getattr(h3_event, "stream_id", None)
            if headers and stream_id is not None and not self.status(stream_id).done():
                self.status(stream_id).set_result(int(dict(headers)[b":status"]))


def _request_headers(stack: Stack, filler_bytes: int) -> list[tuple[bytes, bytes]]:
    """A GET with about ``filler_bytes`` of extra field lines, 2 KiB each
    (the QPACK encoder refuses much longer values)."""
    lines = [(b":method", b"GET"), (b":scheme", b"https"),
             (b":authority", f"127.0.0.1:{_port(stack)}".encode()), (b":path", b"/healthz")]
    for index in range(0, filler_bytes, 2048):
        lines.append((b"x-filler-%d" % index, b"a" * min(2048, filler_bytes - index)))
    return lines


def _oversized(client: _Recorder, stack: Stack, declared_only: bool) -> int:
    """Send one oversized header block on a new stream; its id."""
    stream_id = client._quic.get_next_available_stream_id()
    if declared_only:
        # A HEADERS frame that declares 1 GiB and sends 1 KiB of it.
        client._quic.send_stream_data(stream_id, encode_uint_var(FrameType.HEADERS)
                                      + encode_uint_var(1 << 30) + b"\0" * 1024)
    else:
        client.h3.send_headers(stream_id, _request_headers(stack, 4 * MAX_FIELD_SECTION),
                               end_stream=True)
    client.transmit()
    return stream_id


async def _status(client: _Recorder, stack: Stack, filler_bytes: int) -> int:
    stream_id = client._quic.get_next_available_stream_id()
    client.h3.send_headers(stream_id, _request_headers(stack, filler_bytes), end_stream=True)
    client.transmit()
    with anyio.fail_after(5):
        return await client.status(stream_id)


async def _header_attack(stack: Stack, declared_only: bool) -> float:
    """One connection sends an oversized header block; how long until its
    431 came back (asserting the connection then serves the next request)."""
    async with connect("127.0.0.1", _port(stack), configuration=_client_configuration(stack),
                       create_protocol=_Recorder) as client:
        assert isinstance(client, _Recorder)
        sent_at = time.monotonic()
        stream_id = _oversized(client, stack, declared_only)
        with anyio.fail_after(HEADER_CUT_BUDGET_S * 5):
            assert await client.status(stream_id) == 431
        answered = time.monotonic() - sent_at
        assert await _status(client, stack, 0) == 200  # the connection lives on
        assert not client.terminated.done()
        return answered


async def test_oversized_http3_header_blocks_are_refused_on_their_stream(stack: Stack) -> None:
    before = await _scrape(stack)
    attacks = 20

    async def attack() -> list[float]:
        return [await _header_attack(stack, declared_only=bool(i % 2)) for i in range(attacks)]

    answered_after, good = await _during(stack, attack)
    print(f"headers: {attacks} answered 431 after max {max(answered_after) * 1000:.0f} ms")
    assert max(answered_after) <= HEADER_CUT_BUDGET_S, answered_after
    after = await _scrape(stack)
    refused = after["hedgerow_h3_headers_refused_total"] - before["hedgerow_h3_headers_refused_total"]
    assert refused == attacks
    good.check(minimum=3)
    # A header block just under the limit is still served.
    async with connect("127.0.0.1", _port(stack), configuration=_client_configuration(stack),
                       create_protocol=_Recorder) as client:
        assert isinstance(client, _Recorder)
        assert await _status(client, stack, MAX_FIELD_SECTION - 1024) == 200


REFUSALS_ALLOWED = QuicLimits().h3_max_refused_header_sections  # the gateway's default


REPEAT_ATTACK_S = 1.5  # new abusive connections, one after another, this long


async def test_a_connection_repeating_oversized_header_blocks_is_cut(stack: Stack) -> None:
    before = await _scrape(stack)

    async def one() -> float:
        async with connect("127.0.0.1", _port(stack),
                           configuration=_client_configuration(stack),
                           create_protocol=_Recorder) as client:
            assert isinstance(client, _Recorder)
            sent_at = time.monotonic()
            for n in range(REFUSALS_ALLOWED + 1):  # all at once, as an abuser would
                _oversized(client, stack, declared_only=bool(n % 2))
            with anyio.fail_after(HEADER_CUT_BUDGET_S * 5):
                closed = await client.terminated
            assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD, closed
            return time.monotonic() - sent_at

    async def attack() -> list[float]:
        # One connection is cut in ~0.2 s: new ones follow, so the good
        # client is measured over more than a request or two.
        cut_after: list[float] = []
        started = time.monotonic()
        while not cut_after or time.monotonic() - started < REPEAT_ATTACK_S:
            cut_after.append(await one())
        return cut_after

    cut_after, good = await _during(stack, attack)
    print(f"headers: {len(cut_after)} repeating connections cut after max "
          f"{max(cut_after) * 1000:.0f} ms")
    assert max(cut_after) <= HEADER_CUT_BUDGET_S, cut_after
    after = await _scrape(stack)
    cut = (after["hedgerow_h3_header_connections_cut_total"]
           - before.get("hedgerow_h3_header_connections_cut_total", 0))
    assert cut == len(cut_after)
    good.check(minimum=3)


async def _served_fresh(stack: Stack) -> None:
    """A new HTTP/3 connection's request is answered 200 within the budget."""
    response = await h3_request("127.0.0.1", _port(stack), path="/healthz",
                                cafile=stack.ca_cert, timeout_s=GOOD_MAX_BUDGET_S,
                                ticket_wait_s=0)
    assert response.status == 200


async def test_one_request_cannot_stop_http3_for_every_other_connection(
        stack: Stack) -> None:
    # Hypercorn handles all HTTP/3 connections of a process in one task; each
    # of these once ended or blocked it, so no HTTP/3 request was answered
    # again until a restart.
    async with connect("127.0.0.1", _port(stack), configuration=_client_configuration(stack),
                       create_protocol=_Recorder) as client:
        assert isinstance(client, _Recorder)
        # 1. DATA after the response ended (KeyError in hypercorn).
        late = client._quic.get_next_available_stream_id()
        client.h3.send_headers(late, _request_headers(stack, 0), end_stream=False)
        client.transmit()
        with anyio.fail_after(5):
            assert await client.status(late) == 200
        await anyio.sleep(0.2)  # the response has ended: hypercorn forgot the stream
        client.h3.send_data(late, b"x" * 100, end_stream=True)
        client.transmit()
        await _served_fresh(stack)
        # 2. A body of many chunks for a route that never reads one (its queue
        #    holds 10; the 11th blocked the task for good).
        unread = client._quic.get_next_available_stream_id()
        client.h3.send_headers(unread, _request_headers(stack, 0), end_stream=False)
        for _ in range(40):
            client.h3.send_data(unread, b"x" * 100, end_stream=False)
        client.transmit()
        await _served_fresh(stack)
        # 3. A trailer section (taken for a new request without :method).
        trailed = client._quic.get_next_available_stream_id()
        client.h3.send_headers(trailed, _request_headers(stack, 0), end_stream=False)
        client.h3.send_data(trailed, b"{}", end_stream=False)
        client.h3.send_headers(trailed, [(b"x-trailer", b"1")], end_stream=True)
        client.transmit()
        with anyio.fail_after(5):
            assert await client.status(trailed) == 200
        await _served_fresh(stack)
        assert not client.terminated.done()


def _answers_to(stack: Stack, datagram: bytes) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(0.5)
        sock.sendto(datagram, ("127.0.0.1", _port(stack)))
        answers = 0
        try:
            while True:
                sock.recv(65536)
                answers += 1
        except TimeoutError:
            return answers


def test_version_negotiation_packets_are_not_answered(stack: Stack) -> None:
    """A spoofed Version Negotiation packet naming another QUIC server would
    otherwise start a loop of them between the two."""
    cids = bytes([8]) + b"\x11" * 8 + bytes([8]) + b"\x22" * 8
    unknown_version = bytes([0xC0]) + bytes.fromhex("1a2a3a4a") + cids + b"\0" * 1200
    negotiation = bytes([0x80]) + b"\0\0\0\0" + cids + bytes.fromhex("00000001")
    assert _answers_to(stack, unknown_version) == 1  # still told which versions we speak
    assert _answers_to(stack, negotiation) == 0
