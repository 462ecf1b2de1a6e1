"""The load generator against a small streaming server with known behaviour.

The fake server runs in this process on 127.0.0.1:0 (Hypercorn, like the
worker). Each request's JSON body says how to answer: how many tokens, how
far apart, or which way to fail. Because server and load generator share one
event loop, a server that blocks the loop also freezes the generator — the
situation in which a naive load tool sends late and hides the stall.
"""

from __future__ import annotations

import random
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
import trustme
from hypercorn.asyncio import serve

from bench.loadgen import (
    ClosedLoop,
    HttpClients,
    OpenLoop,
    RequestSpec,
    Target,
    poisson_arrivals,
    run_load,
)
from bench.records import RequestRecord
from bench.stats import fraction_at_most, percentile, summarize_ms
from hedgerow.asgi import (
    SSE_DONE,
    SSE_HEADERS,
    Receive,
    Scope,
    Send,
    handle_lifespan,
    send_json,
    sse_event,
    wait_for_disconnect,
)
from hedgerow.serving import bind_tcp, internal_config, serve_internal


class FakeLlmServer:
    """Streams ``tokens`` chat chunks ``gap_ms`` apart after ``first_ms``; ``behaviour`` picks a failure."""

    def __init__(self) -> None:
        self.active = 0
        self.max_active = 0
        self.client_addresses: set[tuple[str, int]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await handle_lifespan(receive, send)
            return
        spec = orjson.loads(await _read_body(receive))
        self.client_addresses.add(tuple(scope["client"]))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self._answer(spec, receive, send)
        finally:
            self.active -= 1

    async def _answer(self, spec: dict[str, Any], receive: Receive, send: Send) -> None:
        behaviour = spec.get("behaviour", "ok")
        if behaviour == "refuse":
            envelope = {"error": {"message": "slow down", "type": "rate_limit_exceeded",
                                  "param": None, "code": "rate_limit_exceeded"}}
            await send_json(send, 429, envelope, [(b"retry-after", b"1")])
            return
        if behaviour == "freeze":
            time.sleep(spec["freeze_s"])  # blocks the whole event loop, load generator included
        if behaviour == "hang":
            await wait_for_disconnect(receive)  # answers nothing until the client gives up
            return
        headers = list(SSE_HEADERS) + [(b"x-hedgerow-worker", b"fake-1"), (b"x-hedgerow-hedged", b"0")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await anyio.sleep(spec.get("first_ms", 0) / 1000)
        for number in range(spec.get("tokens", 3)):
            if number:
                await anyio.sleep(spec.get("gap_ms", 0) / 1000)
            await _send_body(send, sse_event(_chunk(f"t{number} ")))
            if behaviour == "error_event":
                await _send_body(send, sse_event({"error": {"message": "boom", "type": "upstream_error",
                                                            "param": None, "code": "upstream_failed"}}))
                break
            if behaviour == "cut":
                return  # response left unfinished: the server drops the connection
        if behaviour != "truncate":
            await _send_body(send, SSE_DONE)
        await send({"type": "http.response.body", "body": b""})


def _chunk(text: str) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


async def _send_body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


@asynccontextmanager
async def fake_server() -> AsyncIterator[tuple[str, FakeLlmServer]]:
    server = FakeLlmServer()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_internal, server, "127.0.0.1", 0, stop)
        url = f"http://127.0.0.1:{port}"
        try:
            await _wait_until_serving(url)
            yield url, server
        finally:
            stop.set()


async def _wait_until_serving(url: str, verify: ssl.SSLContext | bool = True) -> None:
    async with httpx.AsyncClient(verify=verify) as client:
        with anyio.fail_after(10):
            while True:
                try:
                    await client.get(url + "/")
                    return
                except httpx.ConnectError:
                    await anyio.sleep(0.01)


def always(**body: Any) -> Any:
    return lambda index, rng: RequestSpec(tag="all", body=body)


# -- schedules ----------------------------------------------------------------


def test_poisson_arrival_count_is_rate_times_duration() -> None:
    offsets = list(poisson_arrivals(200.0, random.Random(5), duration_s=50.0))
    assert len(offsets) == pytest.approx(10_000, abs=500)  # 5 standard deviations
    assert offsets == sorted(offsets) and offsets[-1] < 50.0
    gaps = [b - a for a, b in zip([0.0] + offsets, offsets)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 200, rel=0.05)
    spread = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert spread / mean == pytest.approx(1.0, abs=0.05), "exponential gaps: std == mean"


def test_poisson_arrivals_stop_at_count_or_duration_whichever_first() -> None:
    assert len(list(poisson_arrivals(100.0, random.Random(1), count=7))) == 7
    assert len(list(poisson_arrivals(100.0, random.Random(1), count=10_000, duration_s=1.0))) < 200


def test_load_shapes_refuse_to_run_forever() -> None:
    with pytest.raises(ValueError):
        OpenLoop(rate_per_s=10)
    with pytest.raises(ValueError):
        ClosedLoop(concurrency=4)


# -- stats ----------------------------------------------------------------------


def test_percentiles_use_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert [percentile(values, q) for q in (50, 95, 99, 99.9, 100)] == [50, 95, 99, 100, 100]
    assert percentile([7.0], 50) == 7.0
    summary = summarize_ms([0.001 * v for v in range(1, 1001)])
    assert (summary["count"], summary["p50"], summary["p999"], summary["max"]) == (1000, 500.0, 999.0, 1000.0)
    assert summarize_ms([])["p99"] is None


def test_fraction_at_most_counts_missing_values_as_misses() -> None:
    assert fraction_at_most([0.1, 0.5, None, 2.0], 1.0) == 0.5


# -- open loop over real sockets ----------------------------------------------


@pytest.mark.anyio
async def test_open_loop_sends_about_rate_times_duration_and_measures_streams() -> None:
    async with fake_server() as (url, _):
        result = await run_load(Target(url), OpenLoop(rate_per_s=80, duration_s=1.0),
                                always(tokens=4, first_ms=5, gap_ms=10), seed=3)
    summary = result.summary()["overall"]
    assert 40 <= summary["requests"] <= 120
    assert summary["ok"] == summary["requests"]
    assert summary["ttft_ms"]["p50"] >= 5
    assert summary["itl_ms"]["count"] == 3 * summary["requests"]
    assert summary["itl_ms"]["p50"] >= 9
    assert summary["e2e_ms"]["p50"] >= 35
    assert summary["headers"]["x-hedgerow-worker"] == {"fake-1": summary["requests"]}
    assert result.records[0].http_version == "HTTP/1.1"


@pytest.mark.anyio
async def test_a_stall_shows_up_in_the_latency_of_requests_scheduled_during_it() -> None:
    offsets = tuple(round(0.05 * i, 2) for i in range(21))  # every 50 ms for 1 s

    def factory(index: int, rng: random.Random) -> RequestSpec:
        if offsets[index] == 0.2:  # this request freezes server *and* load generator for 0.4 s
            return RequestSpec("stall", {"behaviour": "freeze", "freeze_s": 0.4, "tokens": 1})
        return RequestSpec("probe", {"tokens": 1})

    async with fake_server() as (url, _):
        result = await run_load(Target(url), OpenLoop(offsets_s=offsets), factory)
    during = [r for r in result.records if 0.3 <= r.intended_s <= 0.55]
    assert len(during) == 6
    for record in during:
        stall_left = 0.6 - record.intended_s
        assert record.ttft_s is not None and record.ttft_s >= stall_left - 0.01
        # They really were sent late; timed from the actual send they would look fast.
        assert record.send_delay_s is not None and record.send_delay_s >= stall_left - 0.05
    after = [r for r in result.records if r.intended_s >= 0.9]
    assert all(r.ttft_s is not None and r.ttft_s < 0.25 for r in after)
    assert all(r.ok for r in result.records)


@pytest.mark.anyio
async def test_the_in_flight_cap_drops_arrivals_instead_of_delaying_them() -> None:
    offsets = tuple(0.01 * i for i in range(10))
    async with fake_server() as (url, _):
        result = await run_load(Target(url), OpenLoop(offsets_s=offsets, max_in_flight=3),
                                always(tokens=1, first_ms=500))
    summary = result.summary()["overall"]
    assert (summary["ok"], summary["errors"]) == (3, {"dropped": 7})
    sent = [r for r in result.records if r.error is None]
    assert [r.index for r in sent] == [0, 1, 2]
    assert all(r.send_delay_s is not None and r.send_delay_s < 0.05 for r in sent)


@pytest.mark.anyio
async def test_errors_are_counted_by_kind() -> None:
    behaviours = ["ok", "refuse", "error_event", "cut", "truncate", "hang"]

    def factory(index: int, rng: random.Random) -> RequestSpec:
        return RequestSpec(behaviours[index], {"behaviour": behaviours[index], "tokens": 3})

    async with fake_server() as (url, _):
        target = Target(url, request_timeout_s=0.5)
        result = await run_load(target, OpenLoop(offsets_s=(0,) * 6), factory)
    summary = result.summary()
    assert summary["overall"]["errors"] == {"http_status": 1, "sse_error": 1, "truncated": 1,
                                            "transport": 1, "timeout": 1}
    assert summary["overall"]["status"] == {"200": 4, "429": 1}
    assert summary["overall"]["error_codes"]["rate_limit_exceeded"] == 1
    assert summary["overall"]["error_codes"]["upstream_failed"] == 1
    refused = summary["by_tag"]["refuse"]
    assert refused["refused_ms"]["count"] == 1 and refused["headers"]["retry-after"] == {"1": 1}
    by_index = {r.tag: r for r in result.records}
    assert by_index["ok"].ok and by_index["ok"].tokens == 3
    assert by_index["error_event"].ttft_s is not None, "the token before the error counted"
    assert by_index["hang"].e2e_s is not None and 0.45 <= by_index["hang"].e2e_s < 2.0


@pytest.mark.anyio
async def test_summary_splits_by_tag_and_is_json() -> None:
    def factory(index: int, rng: random.Random) -> RequestSpec:
        if index % 2:
            return RequestSpec("batch", {"tokens": 6}, headers={"authorization": "Bearer batch"})
        return RequestSpec("interactive", {"tokens": 2})

    async with fake_server() as (url, _):
        result = await run_load(Target(url), OpenLoop(rate_per_s=200, count=20), factory, seed=9)
    summary = orjson.loads(orjson.dumps(result.summary()))
    assert summary["load"]["mode"] == "open"
    assert summary["by_tag"]["interactive"]["requests"] == 10
    assert summary["by_tag"]["batch"]["requests"] == 10
    assert summary["by_tag"]["batch"]["tokens_per_s"] > summary["by_tag"]["interactive"]["tokens_per_s"]
    assert summary["overall"]["ok"] == 20
    assert len(orjson.loads(orjson.dumps(result.record_dicts()))) == 20


# -- closed loop, HTTP/2, TLS -----------------------------------------------------


@pytest.mark.anyio
async def test_closed_loop_holds_exactly_its_concurrency() -> None:
    async with fake_server() as (url, server):
        result = await run_load(Target(url), ClosedLoop(concurrency=3, count=12),
                                always(tokens=2, first_ms=20))
    assert server.max_active == 3
    assert len(server.client_addresses) == 3, "one kept-alive HTTP/1.1 connection per user"
    assert [r.index for r in result.records] == list(range(12))
    assert all(r.ok for r in result.records)
    assert all(r.send_delay_s is not None and r.send_delay_s < 0.01 for r in result.records)


@pytest.mark.anyio
async def test_http2_over_tls_with_a_private_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, cert_file = tmp_path / "ca.pem", tmp_path / "cert.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert_file)
    server_tls.set_alpn_protocols(["h2", "http/1.1"])
    sock = bind_tcp("127.0.0.1", 0)
    config = internal_config(sock, tls=server_tls)  # it serves TLS with the context given
    url = f"https://127.0.0.1:{sock.getsockname()[1]}"
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(FakeLlmServer(), config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
        await _wait_until_serving(url, ssl.create_default_context(cafile=str(ca_file)))
        target = Target(url, http_version="2", ca_file=ca_file)
        async with HttpClients(target) as clients:
            result = await run_load(target, ClosedLoop(concurrency=4, count=8), always(tokens=2),
                                    clients=clients)
        stop.set()
    assert all(r.ok and r.http_version == "HTTP/2" for r in result.records)


def test_a_failure_is_recorded_once() -> None:
    record = RequestRecord(index=0, tag="t", intended_s=0.0)
    record.fail("sse_error", "first")
    record.fail("truncated")
    assert (record.error, record.error_detail, record.ok) == ("sse_error", "first", False)
