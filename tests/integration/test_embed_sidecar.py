"""The MiniLM sidecar with the real model: what the semantic cache relies on.

One sidecar (a real ``python -m gateway.cache.embed_server`` child) serves
the whole module, driven from a blocking portal's event loop so that the
tests share it; the reference vectors come from the same model loaded
in-process. What the cache notices: the sidecar's vectors are the model's;
concurrent embeds are batched and each gets its own answer; when the child
is SIGKILLed, waiting and new embeds are misses (``EmbedderBusy``) at once,
and a new child serves again after a restart.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from gateway.cache.embed_sidecar import SidecarEmbedder
from gateway.cache.embedder import EmbedderBusy, encode, load_minilm
from hedgerow.actors import RestartPolicy

pytestmark = pytest.mark.e2e

QUESTIONS = [f"How far is {n} km in miles?" for n in range(40)] + [
    "What is the capital of France?", "Explain TCP slow start in one sentence.",
    "ünïcödé text: 東京 is the capital of Japan", "x" * 5000]


@pytest.fixture(scope="module")
def model() -> Any:
    return load_minilm(threads=1)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[tuple[BlockingPortal, SidecarEmbedder]]:
    embedder = SidecarEmbedder(restart_policy=RestartPolicy(backoff_initial=0.2))
    with start_blocking_portal() as portal:
        future, _ = portal.start_task(embedder.run)  # returns once the child is ready
        try:
            yield portal, embedder
        finally:
            pid = embedder.pid
            future.cancel()
            if pid is not None:
                _wait_until(lambda: not _alive(pid), 10, f"the sidecar {pid} to be reaped")


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.asarray(np.sum(a * b, axis=1) / norms)


async def _embed_all(embedder: SidecarEmbedder, texts: list[str]) -> list[np.ndarray | str]:
    """Every text embedded at once; a miss as the string ``"busy"``."""
    results: list[np.ndarray | str] = ["none"] * len(texts)

    async def one(i: int) -> None:
        try:
            results[i] = await embedder.embed(texts[i])
        except EmbedderBusy:
            results[i] = "busy"

    async with anyio.create_task_group() as tg:
        for i in range(len(texts)):
            tg.start_soon(one, i)
    return results


def test_sidecar_vectors_agree_with_the_model_in_process(
        sidecar: tuple[BlockingPortal, SidecarEmbedder], model: Any) -> None:
    portal, embedder = sidecar
    vectors = np.stack([portal.call(embedder.embed, q) for q in QUESTIONS])
    assert vectors.shape == (len(QUESTIONS), embedder.dim) and vectors.dtype == np.float32
    assert np.all(_cosines(vectors, encode(model, QUESTIONS)) > 0.999)


def test_concurrent_embeds_are_batched_and_each_gets_its_own_answer(
        sidecar: tuple[BlockingPortal, SidecarEmbedder], model: Any) -> None:
    portal, embedder = sidecar
    texts = [f"question number {n} about the weather in city {n * 7}" for n in range(64)]
    results = portal.call(_embed_all, embedder, texts)
    assert all(isinstance(r, np.ndarray) for r in results)
    # Each answer is its own text's vector, not a neighbour's: ids multiplex correctly.
    assert np.all(_cosines(np.stack(results), encode(model, texts)) > 0.999)
    assert embedder.largest_batch > 1


def test_a_killed_sidecar_means_misses_at_once_then_it_serves_again(
        sidecar: tuple[BlockingPortal, SidecarEmbedder], model: Any) -> None:
    portal, embedder = sidecar
    first = embedder.pid
    assert first is not None and embedder.ready

    async def kill_while_busy() -> tuple[list[np.ndarray | str], float]:
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def flood() -> None:
                results.extend(await _embed_all(embedder, [f"long text {n} " * 300
                                                           for n in range(200)]))

            tg.start_soon(flood)
            await anyio.sleep(0.05)
            os.kill(first, signal.SIGKILL)
            killed = anyio.current_time()
        return results, anyio.current_time() - killed

    results, waited_s = portal.call(kill_while_busy)
    # Whatever was still waiting failed as a miss within moments, not a timeout;
    # on a fast machine some were embedded before the kill (vectors, not strings).
    misses = [r for r in results if isinstance(r, str)]
    assert "busy" in misses and "none" not in misses
    assert waited_s < 2.0
    assert not embedder.ready
    with pytest.raises(EmbedderBusy):
        portal.call(embedder.embed, "asked while the sidecar is down")
    _wait_until(lambda: embedder.ready, 180, "the sidecar to come back")
    assert embedder.pid not in (None, first) and not _alive(first)
    vector = portal.call(embedder.embed, QUESTIONS[0])
    assert _cosines(vector[None], encode(model, QUESTIONS[:1]))[0] > 0.999
