"""Resumable streams, heartbeats and slow readers, through the real gateway app.

The ``GatewayApp`` is called as an ASGI app by in-memory clients that can hang
up or read slowly; the scheduler and dispatcher are real, the workers are the
``MockTransport`` twins of ``tests.support.fake_workers``, which record
every generation and whether the gateway hung up on it. So each test checks
what a client sees (event ids, the text, error events, statuses) and what the
worker did (generated once, stopped or not).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import pytest

from gateway.app import GatewayApp
from gateway.cache import ResponseCache
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.schema import hash_api_key
from tests.integration.test_dispatch import make_policy, running
from tests.support.asgi_client import Client, Gateway
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio

TOKENS = tuple(f" t{i}" for i in range(12))
TENANTS = [
    {"name": "t", "class": "interactive"},
    {"name": "u", "class": "interactive", "api_key_sha256": [hash_api_key("key-u")]},
]


@asynccontextmanager
async def gateway(behaviour: Behaviour, *, cache: dict[str, Any] | None = None,
                  embedder: Any = None, **streams: Any) -> AsyncIterator[Gateway]:
    """The app over one fake worker ``a``; ``cache`` (a policy section) turns the
    response cache on, in-process, with ``embedder`` for semantic lookups."""
    sections: dict[str, Any] = {"cache": cache or {"enabled": False}}
    policy = make_policy(streams=streams, tenants=TENANTS, hedging={"enabled": False},
                         **sections)
    async with running(policy, {"a": behaviour}) as rig:
        responses = None if cache is None else ResponseCache(policy, embedder=embedder)
        app = GatewayApp(policy, LatestValue(RegistrySnapshot(version=0)), rig.scheduler,
                         rig.dispatcher, cache=responses)
        async with anyio.create_task_group() as tg:
            if responses is not None:
                await tg.start(responses.run)
            yield Gateway(app, rig.workers, tg)
            tg.cancel_scope.cancel()


async def until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


def token_events(client: Client) -> int:
    return sum(1 for e in client.events() if "\"content\":\" " in e.data)


async def test_every_event_carries_an_increasing_id_and_the_stream_ends_done() -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        client = await gw.stream()
        await until(client.finished.is_set)
    events = client.events()
    assert client.status == 200 and events[-1].data == "[DONE]"
    ids = [int(e.id or 0) for e in events]
    # Increasing from 1; the usage event's id is skipped when the client did not ask for usage.
    assert ids[0] == 1 and ids == sorted(set(ids)) and ids[-1] - ids[0] <= len(ids)
    assert client.text() == "".join(TOKENS)


async def test_a_cut_stream_resumes_after_its_last_event_id_and_the_worker_generates_once() -> None:
    async with gateway(Behaviour(tokens=TOKENS, token_gap_s=0.03), resume_grace_ms=5000) as gw:
        whole = await gw.stream()
        await until(whole.finished.is_set)

        cut = await gw.stream()
        await until(lambda: token_events(cut) >= 4)
        cut.hang_up.set()
        await until(cut.finished.is_set)
        request_id = cut.header("x-request-id")
        last_seen = int(cut.events()[-1].id or 0)

        resumed = await gw.resume(request_id, last_seen)
        await until(resumed.finished.is_set)
        assert resumed.status == 200 and resumed.header("x-request-id") == request_id
        assert int(resumed.events()[0].id or 0) == last_seen + 1
        assert cut.text() + resumed.text() == whole.text() == "".join(TOKENS)
        assert resumed.events()[-1].data == "[DONE]"
        calls = gw.workers.calls_for(request_id)
        assert len(calls) == 1 and calls[0].completed and not calls[0].hung_up


async def test_resume_works_from_the_start_and_after_the_stream_finished() -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        first = await gw.stream()
        await until(first.finished.is_set)
        again = await gw.resume(first.header("x-request-id"), None)
        await until(again.finished.is_set)
        assert again.raw() == first.raw()


async def test_a_stream_nobody_resumes_stops_on_the_worker_after_the_grace() -> None:
    long = tuple(f" w{i}" for i in range(400))
    async with gateway(Behaviour(tokens=long, token_gap_s=0.01), resume_grace_ms=300) as gw:
        cut = await gw.stream()
        await until(lambda: token_events(cut) >= 2)
        cut.hang_up.set()
        left = anyio.current_time()
        await until(lambda: gw.workers.calls[0].hung_up)
        stopped_after = anyio.current_time() - left
        assert 0.25 <= stopped_after < 1.5, stopped_after
        # A late resume replays what was generated, then the reason it stopped.
        late = await gw.resume(cut.header("x-request-id"), 0)
        await until(late.finished.is_set)
        last = orjson.loads(late.events()[-1].data)
        assert last["error"]["code"] == "stream_cancelled"


async def test_a_client_leaving_before_the_first_token_stops_the_worker_at_once() -> None:
    hold = anyio.Event()
    async with gateway(Behaviour(tokens=TOKENS, hold=hold), resume_grace_ms=5000) as gw:
        client = await gw.stream()
        await until(lambda: len(gw.workers.calls) == 1)
        client.hang_up.set()
        await until(lambda: gw.workers.calls[0].hung_up, timeout=1.0)
        assert client.sent == []


async def test_cancel_stops_the_generation_for_every_reader_with_an_error_event() -> None:
    long = tuple(f" w{i}" for i in range(400))
    async with gateway(Behaviour(tokens=long, token_gap_s=0.01)) as gw:
        reader = await gw.stream()
        await until(lambda: token_events(reader) >= 2)
        cancel = gw.start(Client("POST", f"/v1/chat/completions/{reader.header('x-request-id')}"
                                 "/cancel"))
        await until(cancel.finished.is_set)
        assert cancel.status == 200 and cancel.json()["cancelled"] is True
        await until(reader.finished.is_set)
        last = orjson.loads(reader.events()[-1].data)
        assert last["error"]["code"] == "stream_cancelled"
        assert gw.workers.calls[0].hung_up


async def test_resume_of_an_unknown_or_another_tenants_stream_is_404() -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        mine = await gw.stream()
        await until(mine.finished.is_set)
        unknown = await gw.resume("no-such-stream", 0)
        theirs = await gw.resume(mine.header("x-request-id"), 0,
                                 headers=[(b"authorization", b"Bearer key-u")])
        await until(lambda: unknown.finished.is_set() and theirs.finished.is_set())
        assert unknown.status == theirs.status == 404
        assert unknown.json()["error"]["code"] == theirs.json()["error"]["code"] \
            == "stream_not_found"
        # Another tenant cannot cancel it either.
        cancel = gw.start(Client("POST", f"/v1/chat/completions/{mine.header('x-request-id')}"
                                 "/cancel", headers=[(b"authorization", b"Bearer key-u")]))
        await until(cancel.finished.is_set)
        assert cancel.status == 404


async def test_resume_after_retention_or_past_dropped_events_is_410() -> None:
    async with gateway(Behaviour(tokens=TOKENS), retain_ms=100) as gw:
        old = await gw.stream()
        await until(old.finished.is_set)
        await anyio.sleep(0.25)
        expired = await gw.resume(old.header("x-request-id"), 0)
        await until(expired.finished.is_set)
        assert expired.status == 410 and expired.json()["error"]["code"] == "stream_gone"

    many = tuple(" " + "x" * 600 for _ in range(20))  # ~16 KB of events, 4 KB kept
    async with gateway(Behaviour(tokens=many), max_buffer_bytes=4096) as gw:
        big = await gw.stream()
        await until(big.finished.is_set)
        dropped = await gw.resume(big.header("x-request-id"), 1)
        await until(dropped.finished.is_set)
        assert dropped.status == 410


async def test_a_malformed_last_event_id_is_400() -> None:
    async with gateway(Behaviour(tokens=TOKENS)) as gw:
        done = await gw.stream()
        await until(done.finished.is_set)
        bad = await gw.resume(done.header("x-request-id"), "abc")
        past = await gw.resume(done.header("x-request-id"), 10_000)
        await until(lambda: bad.finished.is_set() and past.finished.is_set())
        assert bad.status == past.status == 400


async def test_an_idle_stream_gets_comment_heartbeats() -> None:
    async with gateway(Behaviour(tokens=TOKENS[:3], token_gap_s=0.35), heartbeat_ms=100) as gw:
        client = await gw.stream()
        await until(client.finished.is_set)
    raw = client.raw()
    assert raw.count(b": keep-alive\n\n") >= 4, raw
    assert client.text() == "".join(TOKENS[:3]) and client.events()[-1].data == "[DONE]"


async def test_a_reader_that_falls_behind_the_buffer_gets_an_error_event() -> None:
    many = tuple(" " + "y" * 300 for _ in range(60))  # ~25 KB, produced at once
    async with gateway(Behaviour(tokens=many), max_buffer_bytes=4096) as gw:
        slow = await gw.stream(read_delay_s=0.05)
        await until(slow.finished.is_set, timeout=10)
        assert gw.workers.calls[0].completed  # the generation never waited for the reader
    last = orjson.loads(slow.events()[-1].data)
    assert last["error"]["code"] == "slow_reader"
    assert len(slow.raw()) < 12_000


async def test_a_reader_that_accepts_nothing_is_cut_and_the_generation_carries_on() -> None:
    async with gateway(Behaviour(tokens=TOKENS, token_gap_s=0.02), write_stall_ms=200,
                       resume_grace_ms=5000) as gw:
        stuck = await gw.stream(stuck=True)  # the response starts; no body byte is accepted
        await until(stuck.finished.is_set, timeout=3)
        assert stuck.status == 200
        await until(lambda: gw.workers.calls[0].completed)
        resumed = await gw.resume(stuck.header("x-request-id"), 0)
        await until(resumed.finished.is_set)
        assert resumed.text() == "".join(TOKENS)
