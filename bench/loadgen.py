"""Drive an OpenAI-compatible URL with streaming requests and measure every one.

Two load shapes:

* ``OpenLoop`` — arrivals on a schedule that does not wait for responses:
  Poisson at ``rate_per_s`` for ``duration_s`` and/or ``count`` arrivals, or an
  explicit list of ``offsets_s``. Each arrival is launched as its own task at
  its scheduled time, and every latency is measured from that scheduled
  (intended) time, so a stall anywhere — server, network, this process —
  lands in the numbers of the requests it delayed (no coordinated omission).
  If ``max_in_flight`` requests are already running when an arrival is due,
  that arrival is recorded as ``dropped`` and not sent; the schedule itself
  is never delayed.
* ``ClosedLoop`` — ``concurrency`` users, each sending its next request when
  the previous one ended, for ``duration_s`` and/or ``count`` requests in all.
  The intended send time is the actual one.

What to send comes from a ``RequestFactory``: ``factory(index, rng)`` returns a
``RequestSpec`` (tag, JSON body, extra headers, path), so a run can mix request
classes — say ``"interactive"`` and ``"batch"`` — and the summary breaks every
number down per tag. ``run_load`` returns a ``LoadResult``; see
``bench.records`` for the measurements and their summary.

Example::

    target = Target("https://127.0.0.1:8443", http_version="2", ca_file=ca)
    result = await run_load(target, OpenLoop(rate_per_s=20, duration_s=30), factory, seed=1)
    print(orjson.dumps(result.summary()))
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import httpx
import orjson

from bench.clients import HttpClients, StreamingResponse, Target, open_stream

__all__ = ["ClosedLoop", "HttpClients", "OpenLoop", "RequestFactory", "RequestSpec", "Target",
           "http_version_from_env", "poisson_arrivals", "run_load"]
from bench.h3 import H3Client
from bench.records import LoadResult, RequestRecord
from hedgerow.sse import SseOverflow, SseParser

Clock = Callable[[], float]


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its class tag, JSON body, extra headers and path."""

    tag: str
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    path: str = "/v1/chat/completions"


RequestFactory = Callable[[int, random.Random], RequestSpec]


def http_version_from_env(default: Literal["1.1", "2"] = "1.1") -> Literal["1.1", "2"]:
    """``HEDGEROW_BENCH_HTTP`` (``1.1`` or ``2``) for the scenarios' client, else ``default``."""
    value = os.environ.get("HEDGEROW_BENCH_HTTP", default)
    if value not in ("1.1", "2"):
        raise ValueError(f"HEDGEROW_BENCH_HTTP must be 1.1 or 2, not {value!r}")
    return "2" if value == "2" else "1.1"


@dataclass(frozen=True)
class OpenLoop:
    """Scheduled arrivals: Poisson (``rate_per_s``) or explicit ``offsets_s``."""

    rate_per_s: float = 0.0
    duration_s: float | None = None
    count: int | None = None
    offsets_s: tuple[float, ...] | None = None  # explicit schedule; overrides the Poisson one
    max_in_flight: int = 10_000

    def __post_init__(self) -> None:
        if self.offsets_s is None and (self.rate_per_s <= 0 or (self.duration_s, self.count) == (None, None)):
            raise ValueError("an open loop needs offsets_s, or rate_per_s > 0 with duration_s and/or count")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")

    def arrivals(self, rng: random.Random) -> Iterator[float]:
        if self.offsets_s is not None:
            return iter(sorted(self.offsets_s))
        return poisson_arrivals(self.rate_per_s, rng, duration_s=self.duration_s, count=self.count)

    def describe(self) -> dict[str, Any]:
        if self.offsets_s is not None:
            return {"mode": "open", "arrivals": len(self.offsets_s), "max_in_flight": self.max_in_flight}
        return {"mode": "open", "rate_per_s": self.rate_per_s, "duration_s": self.duration_s,
                "count": self.count, "max_in_flight": self.max_in_flight}


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` users back to back, for ``duration_s`` and/or ``count`` requests."""

    concurrency: int
    duration_s: float | None = None
    count: int | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1 or (self.duration_s, self.count) == (None, None):
            raise ValueError("a closed loop needs concurrency >= 1 and duration_s and/or count")

    def describe(self) -> dict[str, Any]:
        return {"mode": "closed", "concurrency": self.concurrency, "duration_s": self.duration_s,
                "count": self.count}


def poisson_arrivals(
    rate_per_s: float, rng: random.Random, *, duration_s: float | None = None, count: int | None = None
) -> Iterator[float]:
    """Arrival offsets (s) of a Poisson process; stops at ``duration_s`` or after ``count``."""
    offset = 0.0
    produced = 0
    while count is None or produced < count:
        offset += rng.expovariate(rate_per_s)
        if duration_s is not None and offset >= duration_s:
            return
        produced += 1
        yield offset


async def run_load(
    target: Target,
    load: OpenLoop | ClosedLoop,
    factory: RequestFactory,
    *,
    seed: int = 0,
    clients: HttpClients | None = None,
    clock: Clock = time.perf_counter,
) -> LoadResult:
    """Run ``load`` against ``target``; pass ``clients`` to keep connections across runs."""
    arrivals_rng, requests_rng = random.Random(seed), random.Random(seed + 1)
    own_clients = clients is None
    http = clients or HttpClients(target)
    try:
        runner = _Runner(target, http, factory, requests_rng, clock)
        if isinstance(load, OpenLoop):
            await runner.open_loop(load, arrivals_rng)
        else:
            await runner.closed_loop(load)
    finally:
        if own_clients:
            await http.aclose()
    records = sorted(runner.records, key=lambda record: record.index)
    return LoadResult(records=records, wall_s=runner.wall_s, load=load.describe())


class _Runner:
    """One run's shared state: the clients, the records, the clock origin."""

    def __init__(self, target: Target, clients: HttpClients, factory: RequestFactory,
                 rng: random.Random, clock: Clock) -> None:
        self.target = target
        self.clients = clients
        self.factory = factory
        self.rng = rng
        self.clock = clock
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.start = 0.0
        self.wall_s = 0.0

    async def open_loop(self, load: OpenLoop, arrivals_rng: random.Random) -> None:
        self.start = self.clock()
        async with anyio.create_task_group() as tg:
            for index, offset in enumerate(load.arrivals(arrivals_rng)):
                await anyio.sleep(max(0.0, self.start + offset - self.clock()))
                spec, record = self._new_request(index, offset)
                if self.in_flight >= load.max_in_flight:
                    record.fail("dropped", f"{self.in_flight} in flight")
                    continue
                self.in_flight += 1
                tg.start_soon(self._send_counted, spec, record)
        self.wall_s = self.clock() - self.start

    async def closed_loop(self, load: ClosedLoop) -> None:
        self.start = self.clock()
        issued = iter(range(load.count if load.count is not None else 2**62))
        stop_at = self.start + load.duration_s if load.duration_s is not None else float("inf")

        async def user() -> None:
            for index in issued:
                if self.clock() >= stop_at:
                    return
                spec, record = self._new_request(index, self.clock() - self.start)
                await self._send(spec, record)

        async with anyio.create_task_group() as tg:
            for _ in range(load.concurrency):
                tg.start_soon(user)
        self.wall_s = self.clock() - self.start

    def _new_request(self, index: int, offset: float) -> tuple[RequestSpec, RequestRecord]:
        spec = self.factory(index, self.rng)
        record = RequestRecord(index=index, tag=spec.tag, intended_s=offset)
        self.records.append(record)
        return spec, record

    async def _send_counted(self, spec: RequestSpec, record: RequestRecord) -> None:
        try:
            await self._send(spec, record)
        finally:
            self.in_flight -= 1

    async def _send(self, spec: RequestSpec, record: RequestRecord) -> None:
        intended = self.start + record.intended_s
        record.send_delay_s = self.clock() - intended
        try:
            with anyio.fail_after(self.target.request_timeout_s):
                async with self.clients.lease() as client:
                    await _exchange(client, self.target, spec, record, intended, self.clock)
        except (TimeoutError, httpx.TimeoutException) as error:
            record.fail("timeout", type(error).__name__)
        except (httpx.TransportError, ConnectionError) as error:  # H3Error is a ConnectionError
            record.fail("transport", type(error).__name__)
        finally:
            record.e2e_s = self.clock() - intended


async def _exchange(client: httpx.AsyncClient | H3Client, target: Target, spec: RequestSpec,
                    record: RequestRecord, intended: float, clock: Clock) -> None:
    async with open_stream(client, spec.path, spec.body, spec.headers) as response:
        record.status = response.status_code
        record.http_version = response.http_version
        record.headers = {name: response.headers[name]
                          for name in target.headers_of_interest if name in response.headers}
        if response.status_code != 200:
            record.fail("http_status", _error_code(await response.aread(), response.status_code))
        elif response.headers.get("content-type", "").startswith("text/event-stream"):
            await _read_stream(response, record, intended, clock)
        else:
            await response.aread()
            record.ttft_s = clock() - intended


async def _read_stream(response: StreamingResponse, record: RequestRecord,
                       intended: float, clock: Clock) -> None:
    parser = SseParser()
    last_token_at: float | None = None
    done = False
    async for data in response.aiter_bytes():
        arrived = clock()
        try:
            events = parser.feed(data)
        except (SseOverflow, UnicodeDecodeError) as error:
            record.fail("sse_error", f"malformed stream: {error}")
            return
        for event in events:
            kind, detail = _event_kind(event.data)
            if kind == "token":
                if last_token_at is None:
                    record.ttft_s = arrived - intended
                else:
                    record.itl_s.append(arrived - last_token_at)
                last_token_at = arrived
                record.tokens += 1
            elif kind == "error":
                record.fail("sse_error", detail)
            done = done or kind == "done"
    if not done:
        record.fail("truncated")


EventKind = Literal["token", "done", "error", "other"]


def _event_kind(data: str) -> tuple[EventKind, str | None]:
    """What one SSE event's data is: generated text, the end, an error (with its code), or other."""
    if data == "[DONE]":
        return "done", None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return "error", "malformed event"
    if not isinstance(payload, dict):
        return "other", None
    if "error" in payload:
        error = payload["error"]
        return "error", str(error.get("code")) if isinstance(error, dict) else str(error)
    return ("token" if _text_of(payload.get("choices")) else "other"), None


def _text_of(choices: Any) -> str:
    if not isinstance(choices, Sequence) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


def _error_code(body: bytes, status: int) -> str:
    """The OpenAI envelope's ``code`` (or ``type``), else the status."""
    try:
        error = orjson.loads(body)["error"]
        return str(error.get("code") or error.get("type"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return f"http_{status}"
