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
  SETTINGS;
- ``good_before`` / ``good_during``: the good client's p50/p99 seconds,
  requests and errors.

An attack is an ``Attack`` entry: a name, the protocol it targets and a
function that runs it against a ``Stack`` and returns an ``AttackOutcome``.
QUIC floods or per-IP connection floods join by adding entries (their own
client in their own module); the measuring around them stays as it is.
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
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import Frame

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


@dataclass(frozen=True)
class Attack:
    name: str
    protocol: str  # "h2"; later "quic", "tcp" (per-IP floods)
    cve: str
    run: Callable[[Stack], AttackOutcome]


# -- the good client ------------------------------------------------------------------


@dataclass
class GoodClientRun:
    latencies: list[float] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # monotonic, per request
    errors: list[str] = field(default_factory=list)

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        """p50/p99 of the requests started in [since, until]."""
        ordered = sorted(latency for latency, at in zip(self.latencies, self.started)
                         if since <= at <= until)
        p99 = statistics.quantiles(ordered, n=100)[98] if len(ordered) > 1 else None
        return {"p50_s": round(statistics.median(ordered), 4) if ordered else None,
                "p99_s": round(p99, 4) if p99 is not None else None,
                "requests": len(ordered), "errors": len(self.errors)}


class GoodClient(threading.Thread):
    """Streams short completions one after another (a new question each time:
    the worker answers, not the cache) until stopped."""

    def __init__(self, gateway_url: str, ca_cert: Path) -> None:
        super().__init__(daemon=True)
        self.url, self.ca_cert = gateway_url, ca_cert
        self.result = GoodClientRun()
        self.stop = threading.Event()

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

    def finish(self) -> GoodClientRun:
        self.stop.set()
        self.join(15)
        return self.result


def good_client_during(stack: Stack, action: Callable[[], _T], lead_s: float = 0.3
                       ) -> tuple[_T, GoodClientRun]:
    """Run ``action`` while a good client streams; its result and the client's."""
    good = GoodClient(stack.gateway_url, stack.ca_cert)
    good.start()
    time.sleep(lead_s)
    try:
        result = action()
    finally:
        run = good.finish()
    return result, run


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
    def batch(conn: RawH2) -> list[Frame]:
        frames: list[Frame] = []
        for _ in range(100):
            stream = conn.new_stream()
            frames += [conn.request_headers(stream), conn.data(stream, b"x")]
        return frames
    return _flood_outcome(stack, batch, _streams_accepted)


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


ATTACKS: tuple[Attack, ...] = (
    Attack("h2_rapid_reset", "h2", "CVE-2023-44487", rapid_reset),
    Attack("h2_server_resets", "h2", "CVE-2019-9514", server_resets),
    Attack("h2_ping_flood", "h2", "CVE-2019-9512", ping_flood),
    Attack("h2_settings_flood", "h2", "CVE-2019-9515", settings_flood),
    Attack("h2_priority_flood", "h2", "CVE-2019-9513", priority_flood),
    Attack("h2_empty_frames", "h2", "CVE-2019-9518", empty_frames),
    Attack("h2_zero_length_headers", "h2", "CVE-2019-9516", zero_length_headers),
    Attack("h2_empty_header_values", "h2", "CVE-2019-9516", empty_header_values),
)


MIN_ATTACK_S = 1.0  # a quick attack is repeated, one connection after another, this long
MAX_REPEATS = 50


def _repeated(stack: Stack, attack: Attack) -> dict[str, Any]:
    """Run ``attack`` on new connections until MIN_ATTACK_S has passed: the
    worst cut time and the most any one connection got through."""
    outcomes: list[AttackOutcome] = []
    started = time.monotonic()
    while len(outcomes) < MAX_REPEATS and (not outcomes
                                            or time.monotonic() - started < MIN_ATTACK_S):
        outcomes.append(attack.run(stack))
    cuts = [o.cut_after_s for o in outcomes]
    return {"connections": len(outcomes),
            "cut_after_s": None if None in cuts else max(c for c in cuts if c is not None),
            "goaway": sorted({o.goaway or "none" for o in outcomes}),
            "got_through": max(o.got_through for o in outcomes)}


def attacks(quick: bool, workdir: Path) -> dict[str, Any]:
    """Each attack in turn against one gateway; see the module docstring."""
    baseline_s = 2.0 if quick else 10.0
    stack = Stack(workdir)
    results: dict[str, Any] = {}
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway()
        for attack in ATTACKS:
            window: dict[str, float] = {}

            def measured(attack: Attack = attack) -> dict[str, Any]:
                window["since"] = time.monotonic()
                try:
                    return _repeated(stack, attack)
                finally:
                    window["until"] = time.monotonic()

            _, before = good_client_during(stack, lambda: time.sleep(baseline_s), lead_s=0)
            outcome, during = good_client_during(stack, measured)
            results[attack.name] = {"protocol": attack.protocol, "cve": attack.cve, **outcome,
                                    "good_before": before.summary(),
                                    "good_during": during.summary(window["since"],
                                                                  window["until"])}
    finally:
        stack.stop_all()
    return {"scenario": "attacks", "quick": quick, "attacks": results,
            "all_cut": all(r["cut_after_s"] is not None for r in results.values())}
