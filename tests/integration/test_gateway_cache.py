"""The response cache and single-flight, through the real gateway app.

Same rig as ``test_resumable_streams``: the real app, scheduler and
dispatcher over a fake worker that records every generation. Each test checks
what clients see (``x-hedgerow-cache``, the text, the SSE shape, usage) and how
many generations the worker ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import orjson
import pytest

from tests.integration.test_resumable_streams import TOKENS, gateway, until
from tests.support.asgi_client import Client
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio

ON: dict[str, Any] = {"enabled": True, "semantic": {"enabled": False}}


def deterministic(stream: bool = True, content: str = "Count.", **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "stream": stream, "max_tokens": 16, "temperature": 0,
                         "messages": [{"role": "user", "content": content}], **extra})


def chunks(client: Client) -> list[dict[str, Any]]:
    return [orjson.loads(e.data) for e in client.events() if e.data != "[DONE]"]


async def test_an_identical_deterministic_request_is_replayed_from_the_exact_cache() -> None:
    async with gateway(Behaviour(tokens=TOKENS), cache=ON) as gw:
        first = await gw.stream(request=deterministic(stream_options={"include_usage": True}))
        await until(first.finished.is_set)
        again = await gw.stream(request=deterministic(stream_options={"include_usage": True}))
        await until(again.finished.is_set)
        assert len(gw.workers.calls) == 1
    assert first.header("x-hedgerow-cache") == "miss"
    assert again.header("x-hedgerow-cache") == "exact"
    assert again.text() == first.text() == "".join(TOKENS)
    # The replay has the live stream's shape: ids, chunk objects, finish, usage, [DONE].
    events = again.events()
    assert all(e.id for e in events) and events[-1].data == "[DONE]"
    replayed = chunks(again)
    assert {c["object"] for c in replayed} == {"chat.completion.chunk"}
    assert replayed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert replayed[-2]["choices"][0]["finish_reason"] == "stop"
    assert replayed[-1]["usage"] == chunks(first)[-1]["usage"]
    assert again.header("content-type").startswith("text/event-stream")
    assert again.header("x-request-id") != first.header("x-request-id")


async def test_a_non_streaming_hit_is_one_completion_with_usage() -> None:
    async with gateway(Behaviour(tokens=TOKENS), cache=ON) as gw:
        first = await gw.stream(request=deterministic(stream=False))
        await until(first.finished.is_set)
        again = await gw.stream(request=deterministic(stream=False))
        await until(again.finished.is_set)
        assert len(gw.workers.calls) == 1
    live, cached = first.json(), again.json()
    assert again.header("x-hedgerow-cache") == "exact"
    assert cached["object"] == "chat.completion"
    assert cached["choices"][0]["message"]["content"] == live["choices"][0]["message"]["content"]
    assert cached["usage"] == live["usage"]


async def test_no_cache_temperature_and_another_tenant_all_miss() -> None:
    async with gateway(Behaviour(tokens=TOKENS), cache=ON) as gw:
        seeded = await gw.stream(request=deterministic())
        await until(seeded.finished.is_set)
        fresh = await gw.stream(request=deterministic(),
                                headers=[(b"cache-control", b"no-cache")])
        sampled = await gw.stream(request=orjson.dumps(
            {**orjson.loads(deterministic()), "temperature": 0.8}))
        other = await gw.stream(request=deterministic(),
                                headers=[(b"authorization", b"Bearer key-u")])
        await until(lambda: all(c.finished.is_set() for c in (fresh, sampled, other)))
        assert len(gw.workers.calls) == 4
    assert [c.header("x-hedgerow-cache") for c in (fresh, sampled, other)] == ["miss"] * 3


async def test_identical_requests_in_flight_share_one_generation() -> None:
    hold = anyio.Event()
    async with gateway(Behaviour(tokens=TOKENS, token_gap_s=0.01, hold=hold), cache=ON) as gw:
        streams = [await gw.stream(request=deterministic()) for _ in range(8)]
        wholes = [await gw.stream(request=deterministic(stream=False)) for _ in range(2)]
        await until(lambda: len(gw.workers.calls) >= 1)
        await anyio.sleep(0.05)
        hold.set()
        await until(lambda: all(c.finished.is_set() for c in streams + wholes))
        assert len(gw.workers.calls) == 1
    for client in streams:
        assert client.status == 200 and client.text() == "".join(TOKENS)
        assert client.events()[-1].data == "[DONE]"
    for client in wholes:
        assert client.json()["choices"][0]["message"]["content"] == "".join(TOKENS)
    ids = {c.header("x-request-id") for c in streams + wholes}
    assert len(ids) == 10


async def test_a_joined_stream_runs_on_when_the_first_client_leaves() -> None:
    async with gateway(Behaviour(tokens=TOKENS, token_gap_s=0.03), cache=ON,
                       resume_grace_ms=0) as gw:
        leader = await gw.stream(request=deterministic())
        await until(lambda: len(leader.events()) >= 2)
        follower = await gw.stream(request=deterministic())
        await anyio.sleep(0.05)
        leader.hang_up.set()
        await until(follower.finished.is_set)
        assert len(gw.workers.calls) == 1 and gw.workers.calls[0].completed
    assert follower.text() == "".join(TOKENS)


class TableEmbedder:
    """Vectors by question: near questions share one, everything else is
    orthogonal; the pair judge says "the same" only of the ``same`` couples."""

    dim = 8

    def __init__(self, groups: list[list[str]], same: list[tuple[str, str]]) -> None:
        self.table = {q: np.eye(self.dim, dtype=np.float32)[i]
                      for i, group in enumerate(groups) for q in group}
        self.same = {frozenset(couple) for couple in same}

    async def embed(self, text: str) -> np.ndarray:
        return self.table.get(text, np.eye(self.dim, dtype=np.float32)[-1])

    async def judge(self, question: str, cached: Sequence[str]) -> np.ndarray:
        return np.array([float(frozenset((question, c)) in self.same) for c in cached],
                        dtype=np.float32)


async def test_a_paraphrase_is_a_semantic_hit_and_a_changed_number_is_not() -> None:
    asked = "How far is 5 km in miles?"
    paraphrase = "How many miles is 5 km?"
    changed = "How far is 50 km in miles?"
    # All three are one vector apart from nothing: only the judge tells them apart.
    embedder = TableEmbedder([[asked, paraphrase, changed]], same=[(asked, paraphrase)])
    async with gateway(Behaviour(tokens=TOKENS),
                       cache={"enabled": True, "semantic": {"enabled": True}},
                       embedder=embedder) as gw:
        first = await gw.stream(request=deterministic(content=asked))
        await until(first.finished.is_set)
        similar = await gw.stream(request=deterministic(content=paraphrase))
        await until(similar.finished.is_set)
        different = await gw.stream(request=deterministic(content=changed))
        await until(different.finished.is_set)
        assert len(gw.workers.calls) == 2
    assert similar.header("x-hedgerow-cache") == "semantic"
    assert similar.text() == first.text()
    assert different.header("x-hedgerow-cache") == "miss"


async def test_a_failed_generation_is_not_cached() -> None:
    async with gateway(Behaviour(tokens=TOKENS, break_after_tokens=3), cache=ON) as gw:
        broken = await gw.stream(request=deterministic())
        await until(broken.finished.is_set)
        gw.workers.behaviours["a"] = Behaviour(tokens=TOKENS)
        again = await gw.stream(request=deterministic())
        await until(again.finished.is_set)
    assert orjson.loads(broken.events()[-1].data)["error"]["code"]
    assert again.header("x-hedgerow-cache") == "miss" and again.text() == "".join(TOKENS)

