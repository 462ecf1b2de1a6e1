"""``attacks``: known floods against a real gateway, and what a good client sees.

For each attack in ``ATTACKS`` the scenario measures a well-behaved HTTP/2
client (its own tenant, one short streamed completion every 50 ms on its own
connection) for a while with nothing else going on, then again while the
attack runs, and reports per attack:

- ``cut_after_s``: from the abuser's first frame to its connection's end
  (GOAWAY received or closed); None if the abuser was never cut within the
  attack's bounds;
- ``goaway``: the error code of the GOAWAY (``ENHANCE_YOUR_CALM``,
  ``PROTOCOL_ERROR``...), None without one;
- ``got_through``: what the abuser got processed: streams the gateway
  accepted (the GOAWAY's last stream id), or ACKs it received for PINGs and
  SETTINGS, or (server resets) the RST_STREAMs it was sent, or (WINDOW_UPDATE flood) the updates it wrote before it saw the
  cut, an upper bound on those the gateway read;
- ``good_before`` / ``good_during``: the good client's p50/p99 seconds,
  requests and errors.

An attack is an ``Attack`` entry: a name, the protocol it targets, the
gateway flags it needs (attacks with the same flags share one gateway) and a
function that runs it against a ``Stack`` and returns an ``AttackOutcome``.
Besides HTTP/2 there are two floods whose drivers the fault tests share
(``bench.floods``):

- ``quic_initial_flood``: real Initials from 300 source ports at up to 3,000/s
  for ``FLOOD_S`` (the gateway's default QUIC limits). ``cut_after_s``: from
  the first Initial to the last handshake the gateway began for the flood
  (after it, every Initial was Retried or dropped: contained, since a
  spoofable source cannot be cut); ``got_through``: source ports it began a
  real handshake for (held state); ``half_open_gone_after_s``: from the
  flood's end until it holds no half-open connection; ``gateway``: its QUIC
  counters' increase (Retries, refusals by reason, handshake timeouts).
- ``tcp_per_ip_flood``: held TCP connections (never starting TLS) from
  ``PER_IP_SOURCE``, one every 2 ms for ``FLOOD_S``, with loopback not exempt
  from the per-client limits (their defaults otherwise). ``cut_after_s``: the
  longest any connection the gateway closed had lived; ``got_through``: the
  connections still open at the end (what the limits let it keep).

The good client is the same HTTP/2 client throughout (on 127.0.0.1, another
/24 than ``PER_IP_SOURCE``), in a process of its own; the attacks run in a
thread at ``ATTACKER_NICE`` (see there). Its p99 is inclusive: never beyond
the slowest request seen.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import Frame

from bench.floods import ConnectionFlood, connection_flood, quic_initial_flood
from bench.h2raw import RawH2
from bench.stack import Stack

_T = TypeVar("_T")
MODEL = "smollm2-135m-instruct"
CHAT_PATH = "/v1/chat/completions"
GOOD_API_KEY = "sk-demo"  # the default policy's keyed tenant; attackers are anonymous
GOOD_EVERY_S = 0.05
ATTACK_TIMEOUT_S = 10.0
MAX_BATCHES = 2000
SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "2"]


@dataclass
class AttackOutcome:
    cut_after_s: float | None
    goaway: str | None
    got_through: int
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # reported as they are
    # Monotonic time the attack's traffic stopped, when the run went on after it
    # (waiting for the gateway to clean up): the good client's "during" ends there.
    traffic_ended: float | None = None


@dataclass(frozen=True)
class Attack:
    name: str
    protocol: str  # "h2", "quic", "tcp"
    cve: str  # "" where the attack has none
    run: Callable[[Stack], AttackOutcome]
    gateway_args: tuple[str, ...] = ()  # the gateway these run against is started so


# -- the good client ------------------------------------------------------------------


@dataclass
class GoodClientRun:
    latencies: list[float] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # monotonic, per request
    errors: list[str] = field(default_factory=list)
    before: int = 0  # requests finished before the attack began (``good_client_while``)

    @property
    def during(self) -> int:
        """Requests finished since the attack began."""
        return len(self.latencies) - self.before

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        """p50/p99 of the requests started in [since, until]."""
        ordered = sorted(latency for latency, at in zip(self.latencies, self.started)
                         if since <= at <= until)
        # Inclusive: the default (exclusive) method extrapolates beyond the
        # slowest request when there are few of them.
        p99 = (statistics.quantiles(ordered, n=100, method="inclusive")[98]
               if len(ordered) > 1 else None)
        return {"p50_s": round(statistics.median(ordered), 4) if ordered else None,
                "p99_s": round(p99, 4) if p99 is not None else None,
                "requests": len(ordered), "errors": len(self.errors)}


class GoodClient:
    """Streams short completions one after another (a new question each time:
    the worker answers, not the cache) until stopped."""

    def __init__(self, gateway_url: str, ca_cert: Path, stop: Any, finished: Any) -> None:
        self.url, self.ca_cert = gateway_url, ca_cert
        self.result = GoodClientRun()
        self.stop = stop  # an Event: wait(timeout) -> bool
        self.finished = finished  # a shared counter of requests done (``.value``)

    def run(self) -> None:
        import ssl

        verify = ssl.create_default_context(cafile=str(self.ca_cert))
        with httpx.Client(base_url=self.url, http2=True, timeout=10, verify=verify,
                          headers={"authorization": f"Bearer {GOOD_API_KEY}"}) as http:
            while not self.stop.wait(GOOD_EVERY_S):
                self._one(http)

    def _one(self, http: httpx.Client) -> None:
        started = time.monotonic()
        body = {"model": MODEL, "stream": True, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"hi {started}"}]}
        try:
            response = http.post(CHAT_PATH, json=body)
            if response.status_code != 200 or "[DONE]" not in response.text:
                self.result.errors.append(f"{response.status_code} {response.text[:200]}")
        except httpx.HTTPError as error:
            self.result.errors.append(repr(error))
        self.result.latencies.append(time.monotonic() - started)
        self.result.started.append(started)
        self.finished.value += 1  # only this process writes it


def _good_client_process(url: str, ca_cert: str, stop: Any, finished: Any, out: Any) -> None:
    client = GoodClient(url, Path(ca_cert), stop, finished)
    try:
        client.run()
    finally:
        out.send(client.result)


class GoodClientProcess:
    """A ``GoodClient`` in a process of its own. In a thread it shared the
    GIL with the attacker's Python loop in the same process, and what it
    measured was that contention (seconds on a loaded machine), not the
    gateway."""

    START_WAIT_S = 60.0  # a fresh interpreter imports httpx: seconds on a loaded machine

    def __init__(self, gateway_url: str, ca_cert: Path) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._stop = context.Event()
        self._finished = context.Value("i", 0, lock=False)
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_good_client_process, daemon=True,
            args=(gateway_url, str(ca_cert), self._stop, self._finished, sender))

    @property
    def finished(self) -> int:
        """Requests done so far."""
        return int(self._finished.value)

    def start(self) -> None:
        """Start it and wait for its first request to finish."""
        self._process.start()
        until = time.monotonic() + self.START_WAIT_S
        while self.finished == 0 and self._process.is_alive() and time.monotonic() < until:
            time.sleep(0.02)

    def finish(self) -> GoodClientRun:
        self._stop.set()
        run = (self._results.recv() if self._results.poll(30)
               else GoodClientRun(errors=["the good client never reported"]))
        self._process.join(15)
        if self._process.is_alive():
            self._process.kill()
        return run


# The attacker runs on the gateway's own machine here, and a flood written
# in Python takes a whole core: on a shared 2-core machine that starved the
# gateway and the good client of CPU (the gateway itself was 85% idle
# while the good client waited seconds). A remote attacker costs the gateway
# only what it sends; so the attacker's thread runs at a lower priority,
# still as fast as the CPU left over allows.
ATTACKER_NICE = 5


def lower_thread_priority() -> None:
    """The calling thread (only: Linux priorities are per thread) runs at
    ``ATTACKER_NICE`` from now on; for a thread that exists to attack."""
    import os

    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ATTACKER_NICE)


def _as_attacker(action: Callable[[], _T]) -> _T:
    """``action()`` in a thread of its own at ``ATTACKER_NICE``, so the
    caller's own priority is left as it was."""
    result: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            lower_thread_priority()
            result.append(action())
        except BaseException as error:  # re-raised in the caller
            failure.append(error)

    thread = threading.Thread(target=run, name="attacker", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def good_client_during(stack: Stack, action: Callable[[], _T], lead_s: float = 0.3
                       ) -> tuple[_T, GoodClientRun]:
    """Run ``action`` while a good client streams; its result and the client's."""
    good = GoodClientProcess(stack.gateway_url, stack.ca_cert)
    good.start()
    time.sleep(lead_s)
    try:
        result = _as_attacker(action)
    finally:
        run = good.finish()
    return result, run


def good_client_while(stack: Stack, attack: Callable[[], _T], min_requests: int,
                      max_s: float = 60.0, lead_s: float = 0.3
                      ) -> tuple[list[_T], GoodClientRun]:
    """Run ``attack`` again and again (each run on its own connections) while
    a good client streams, until the client has finished ``min_requests``
    requests since the first run began. A count, not a time: an attack that
    is cut at once (a run may take 20 ms) is still measured over enough
    requests however slow the machine is. ``max_s`` only ends a run that
    starves the client (it then has fewer than ``min_requests``)."""
    good = GoodClientProcess(stack.gateway_url, stack.ca_cert)
    good.start()
    time.sleep(lead_s)
    before = good.finished
    results: list[_T] = []

    def rounds() -> None:
        until = time.monotonic() + max_s
        while not results or (time.monotonic() < until
                              and good.finished - before < min_requests):
            results.append(attack())

    try:
        _as_attacker(rounds)
    finally:
        run = good.finish()
    run.before = before
    return results, run


# -- HTTP/2 attacks -------------------------------------------------------------------


def flood(port: int, cafile: str, batch: Callable[[RawH2], list[Frame]],
          settings: dict[int, int] | None = None) -> tuple[RawH2, float]:
    """Send ``batch(conn)`` again and again until the server cuts the connection
    or the bounds (``MAX_BATCHES``, ``ATTACK_TIMEOUT_S``) run out."""
    conn = RawH2(port, cafile, settings=settings)
    started = time.monotonic()
    for _ in range(MAX_BATCHES):
        if not conn.send(*batch(conn)) or conn.read().cut:
            break
        if time.monotonic() - started > ATTACK_TIMEOUT_S:
            break
    conn.wait_closed(3.0)
    elapsed = time.monotonic() - started
    conn.close()
    return conn, elapsed


def _outcome(conn: RawH2, started: float, got_through: int, note: str = "") -> AttackOutcome:
    said = conn.said
    ends = [t for t in (said.goaway_at, said.closed_at) if t]
    goaway = ErrorCodes(said.goaway_code).name if said.goaway_code is not None else None
    return AttackOutcome(round(min(ends) - started, 4) if ends else None, goaway,
                         got_through, note)


def _streams_accepted(conn: RawH2) -> int:
    last = conn.said.goaway_last_stream
    return (last + 1) // 2 if last else 0


def _flood_outcome(stack: Stack, batch: Callable[[RawH2], list[Frame]],
                   counted: Callable[[RawH2], int]) -> AttackOutcome:
    started = time.monotonic()
    conn, _ = flood(stack.gateway_port, str(stack.ca_cert), batch)
    return _outcome(conn, started, counted(conn))


def rapid_reset(stack: Stack) -> AttackOutcome:
    def batch(conn: RawH2) -> list[Frame]:
        frames: list[Frame] = []
        for _ in range(10):
            stream = conn.new_stream()
            frames += [conn.request_headers(stream), conn.rst(stream)]
        return frames
    return _flood_outcome(stack, batch, _streams_accepted)


def server_resets(stack: Stack) -> AttackOutcome:
    """Streams answered at once, then DATA on each: h2 must reset every one
    (STREAM_CLOSED). ``got_through``: the RST_STREAMs the abuser received
    (what the ``max_error_resets`` budget bounds); its streams are closed in
    the read that opened them, so none is processed."""
    def batch(conn: RawH2) -> list[Frame]:
        frames: list[Frame] = []
        for _ in range(100):
            stream = conn.new_stream()
            frames += [conn.request_headers(stream), conn.data(stream, b"x")]
        return frames
    return _flood_outcome(stack, batch, lambda conn: len(conn.said.reset_streams))


def ping_flood(stack: Stack) -> AttackOutcome:
    return _flood_outcome(stack, lambda conn: [conn.ping(n) for n in range(20)],
                          lambda conn: conn.said.frames.get("PingFrame", 0))


def settings_flood(stack: Stack) -> AttackOutcome:
    frame = RawH2.settings({SettingCodes.INITIAL_WINDOW_SIZE: 65535})
    return _flood_outcome(stack, lambda conn: [frame] * 20,
                          lambda conn: max(0, conn.said.frames.get("SettingsFrame", 0) - 1))


def priority_flood(stack: Stack) -> AttackOutcome:
    """PRIORITY frames for streams never opened, each a new one."""
    def batch(conn: RawH2) -> list[Frame]:
        return [conn.priority(conn.new_stream()) for _ in range(20)]
    return _flood_outcome(stack, batch, _streams_accepted)


WINDOW_UPDATES_PER_BATCH = 20
PING_ACK_WAIT_S = 2.0


def window_update_flood(stack: Stack) -> AttackOutcome:
    """One request, answered; then 1-byte WINDOW_UPDATEs without end, half on
    the connection and half on the answered (closed) stream, for which h2
    raises no event. Nothing they credit is ever used.

    Each batch ends with a PING and the next waits for its ACK: an ACK proves
    the gateway read the batch and let it pass (an overspending read gets a
    GOAWAY instead, its ACKs dropped), so ``got_through`` counts exactly the
    updates the gateway accepted. ``details["allowed"]``: the budget's bound
    for them (10 for the connection, for the stream and for each DATA frame
    the abuser received)."""
    conn = RawH2(stack.gateway_port, str(stack.ca_cert))
    started = time.monotonic()
    stream = conn.new_stream()
    conn.send(conn.request_headers(stream))
    while stream not in conn.said.ended_streams and not conn.said.cut:
        if time.monotonic() - started > ATTACK_TIMEOUT_S:
            break
        conn.read(0.05)
    accepted = 0
    for n in range(MAX_BATCHES):
        if conn.said.cut or time.monotonic() - started > ATTACK_TIMEOUT_S:
            break
        acks = conn.said.frames.get("PingFrame", 0)
        updates = [conn.window_update(k % 2 and stream, 1)
                   for k in range(WINDOW_UPDATES_PER_BATCH)]
        if not conn.send(*updates, conn.ping(n)):
            break
        until = time.monotonic() + PING_ACK_WAIT_S
        while (conn.said.frames.get("PingFrame", 0) == acks and not conn.said.cut
               and time.monotonic() < until):
            conn.read(0.02)
        if conn.said.frames.get("PingFrame", 0) > acks and not conn.said.cut:
            accepted += WINDOW_UPDATES_PER_BATCH
    conn.wait_closed(3.0)
    conn.close()
    outcome = _outcome(conn, started, accepted)
    outcome.details.update(closed=conn.said.closed_at > 0,
                           allowed=10 * (2 + conn.said.frames.get("DataFrame", 0)))
    return outcome


def _single_shot(stack: Stack, frames: Callable[[RawH2], list[Frame]]) -> AttackOutcome:
    conn = RawH2(stack.gateway_port, str(stack.ca_cert))
    started = time.monotonic()
    conn.send(*frames(conn))
    conn.wait_closed(3.0)
    conn.close()
    return _outcome(conn, started, _streams_accepted(conn))


def empty_frames(stack: Stack) -> AttackOutcome:
    def frames(conn: RawH2) -> list[Frame]:
        stream = conn.new_stream()
        return [conn.request_headers(stream, CHAT_PATH, "POST", end_stream=False),
                *[conn.data(stream, b"") for _ in range(100)]]
    return _single_shot(stack, frames)


def zero_length_headers(stack: Stack) -> AttackOutcome:
    return _single_shot(stack, lambda conn: [
        conn.request_headers(conn.new_stream(), extra=[("", "")] * 50)])


def empty_header_values(stack: Stack) -> AttackOutcome:
    return _single_shot(stack, lambda conn: [
        conn.request_headers(conn.new_stream(), extra=[("x-a", "")] * 4000)])


# -- QUIC and TCP floods (drivers in bench.floods, shared with tests/faults) -----------

FLOOD_S = 2.0
QUIC_FLOOD_SOCKETS = 300
QUIC_FLOOD_PPS = 3000
HALF_OPEN_WAIT_S = 15.0  # the default handshake timeout (5 s) and slack
PER_IP_SOURCE = "127.0.1.2"  # loopback holds all of 127/8; not the good client's /24
PER_IP_EVERY_S = 0.002
PER_IP_MAX = 1500
PER_IP_CUT_WAIT_S = 1.0


def _quic_metrics(stack: Stack) -> dict[str, float]:
    """The gateway's QUIC front-door samples: half-open, Retries, refusals by reason."""
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(stack.gateway_metrics()):
        for sample in family.samples:
            if sample.name.startswith("hedgerow_quic"):
                reason = sample.labels.get("reason")
                seen[f"{sample.name}{{{reason}}}" if reason else sample.name] = sample.value
    return seen


def quic_flood(stack: Stack) -> AttackOutcome:
    before = _quic_metrics(stack)
    flood = quic_initial_flood(stack.gateway_port, stack.ca_cert, FLOOD_S,
                               sockets=QUIC_FLOOD_SOCKETS, pps=QUIC_FLOOD_PPS)
    ended = time.monotonic()
    gone: float | None = None
    while time.monotonic() - ended < HALF_OPEN_WAIT_S:
        if _quic_metrics(stack).get("hedgerow_quic_half_open") == 0:
            gone = round(time.monotonic() - ended, 2)
            break
        time.sleep(0.1)
    after = _quic_metrics(stack)
    gateway = {name.removeprefix("hedgerow_quic_"): after[name] - before.get(name, 0.0)
               for name in after if name.endswith("_total") or "_total{" in name}
    # Contained: the last handshake the flood got the gateway to begin (state held);
    # everything after it was answered with a Retry or dropped. Not contained (None)
    # when it still began new ones in the second half of the flood.
    last = max(flood.handshakes.values(), default=0.0)
    return AttackOutcome(
        round(last, 4) if last < FLOOD_S / 2 else None, None, len(flood.handshakes),
        traffic_ended=ended,
        details={"sent": flood.sent, "retries_received": flood.retries,
                 "bytes_sent": flood.sent_bytes, "bytes_answered": flood.answer_bytes,
                 "half_open_gone_after_s": gone,
                 "gateway": {k: v for k, v in sorted(gateway.items()) if v}})


def per_ip_flood(stack: Stack) -> AttackOutcome:
    flood = ConnectionFlood(hold=True)
    connection_flood(stack.gateway_port, flood, source=PER_IP_SOURCE, duration_s=FLOOD_S,
                     every_s=PER_IP_EVERY_S, max_count=PER_IP_MAX, cut_wait_s=PER_IP_CUT_WAIT_S)
    cuts = sorted(flood.cut_after)
    return AttackOutcome(
        round(cuts[-1], 4) if cuts else None, None, flood.still_open,
        details={"opened": flood.opened, "cut": len(cuts),
                 "cut_p50_s": round(statistics.median(cuts), 4) if cuts else None,
                 "connect_errors": len(flood.errors)})


ATTACKS: tuple[Attack, ...] = (
    Attack("h2_rapid_reset", "h2", "CVE-2023-44487", rapid_reset),
    Attack("h2_server_resets", "h2", "CVE-2019-9514", server_resets),
    Attack("h2_ping_flood", "h2", "CVE-2019-9512", ping_flood),
    Attack("h2_settings_flood", "h2", "CVE-2019-9515", settings_flood),
    Attack("h2_priority_flood", "h2", "CVE-2019-9513", priority_flood),
    Attack("h2_window_update_flood", "h2", "", window_update_flood),
    Attack("h2_empty_frames", "h2", "CVE-2019-9518", empty_frames),
    Attack("h2_zero_length_headers", "h2", "CVE-2019-9516", zero_length_headers),
    Attack("h2_empty_header_values", "h2", "CVE-2019-9516", empty_header_values),
    Attack("quic_initial_flood", "quic", "", quic_flood),
    # Loopback is exempt from the per-client limits by default (local proxies, health
    # checks); the flood comes from loopback, so that exemption is lifted here.
    Attack("tcp_per_ip_flood", "tcp", "", per_ip_flood,
           gateway_args=("--connection-limits-exempt", "none")),
)


MIN_ATTACK_S = 1.0  # a quick attack is repeated, one connection after another, this long
MAX_REPEATS = 50


def _repeated(stack: Stack, attack: Attack) -> tuple[dict[str, Any], float | None]:
    """Run ``attack`` on new connections until MIN_ATTACK_S has passed: the
    worst cut time and the most any one connection got through; and when the
    last run's traffic stopped, if it said."""
    outcomes: list[AttackOutcome] = []
    started = time.monotonic()
    while len(outcomes) < MAX_REPEATS and (not outcomes
                                            or time.monotonic() - started < MIN_ATTACK_S):
        outcomes.append(attack.run(stack))
    cuts = [o.cut_after_s for o in outcomes]
    return {"connections": len(outcomes),
            "cut_after_s": None if None in cuts else max(c for c in cuts if c is not None),
            "goaway": sorted({o.goaway or "none" for o in outcomes}),
            "got_through": max(o.got_through for o in outcomes),
            **outcomes[-1].details}, outcomes[-1].traffic_ended


def attacks(quick: bool, workdir: Path) -> dict[str, Any]:
    """Each attack in turn against one gateway; see the module docstring."""
    baseline_s = 2.0 if quick else 10.0
    stack = Stack(workdir)
    results: dict[str, Any] = {}
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        gateway_args: tuple[str, ...] = ()
        gateway = stack.start_gateway()
        for attack in ATTACKS:
            if attack.gateway_args != gateway_args:  # a gateway with the flags it needs
                gateway.stop(timeout=10)
                gateway_args = attack.gateway_args
                gateway = stack.start_gateway(*gateway_args)
            window: dict[str, float] = {}

            def measured(attack: Attack = attack) -> dict[str, Any]:
                window["since"] = time.monotonic()
                try:
                    outcome, traffic_ended = _repeated(stack, attack)
                    if traffic_ended is not None:
                        window["until"] = traffic_ended
                    return outcome
                finally:
                    window.setdefault("until", time.monotonic())

            _, before = good_client_during(stack, lambda: time.sleep(baseline_s), lead_s=0)
            outcome, during = good_client_during(stack, measured)
            results[attack.name] = {"protocol": attack.protocol, "cve": attack.cve, **outcome,
                                    "good_before": before.summary(),
                                    "good_during": during.summary(window["since"],
                                                                  window["until"])}
    finally:
        stack.stop_all()
    return {"scenario": "attacks", "quick": quick, "attacks": results,
            "baseline": "the good client's latency before each attack, on the same gateway",
            "all_cut": all(r["cut_after_s"] is not None for r in results.values())}
