"""The shared embedding sidecar of ``--processes N``: clients of one server
(``SocketEmbedder``) and the supervisor's side (``SharedSidecar``), against
the real server code around the bag-of-words twin
(``tests.support.fake_embed_server``). The gateway processes themselves are
in tests/integration/test_gateway_processes.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from gateway.cache.embed_wire import READY_LINE
from gateway.cache.embedder import EmbedderBusy
from gateway.cache.shared_embedder import SharedSidecar, SocketEmbedder
from tests.support.cache_fakes import bag_of_words

FAKE = ("-m", "tests.support.fake_embed_server")


def _start_server(socket_path: Path, mode: str = "ok") -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, *FAKE, "--mode", mode, "--socket",
                                str(socket_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline().startswith(READY_LINE)
    return process


@pytest.fixture
def server_path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "embed.sock"


async def _until_ready(embedder: SocketEmbedder, timeout_s: float = 10) -> None:
    with anyio.fail_after(timeout_s):
        while not embedder.ready:
            await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_a_client_misses_while_the_server_is_gone_and_reconnects_when_it_is_back(
        server_path: Path) -> None:
    asked: list[int] = []
    embedder = SocketEmbedder(server_path, on_start=lambda: asked.append(1),
                              retry_initial_s=0.02, retry_max_s=0.1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(embedder.run)
        await anyio.sleep(0.2)
        assert asked == [1]  # it asked for the server before there was one
        with pytest.raises(EmbedderBusy):
            await embedder.embed("nobody serves yet")
        server = _start_server(server_path)
        try:
            await _until_ready(embedder)
            assert np.allclose(await embedder.embed("red fox"), bag_of_words("red fox"))
            server.kill()
            server.wait()
            with anyio.fail_after(5):
                while embedder.ready:
                    await anyio.sleep(0.02)
            with pytest.raises(EmbedderBusy):
                await embedder.embed("while it is down")
            server = _start_server(server_path)  # the same path, as its owner restarts it
            await _until_ready(embedder)
            assert np.allclose(await embedder.embed("back again"), bag_of_words("back again"))
            assert embedder.starts == 2
        finally:
            server.kill()
            server.wait()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_two_clients_share_one_server_and_each_gets_its_own_answers(
        server_path: Path) -> None:
    server = _start_server(server_path, "slow")
    clients = [SocketEmbedder(server_path) for _ in range(2)]
    texts = [f"question {n}" for n in range(12)]
    results: dict[tuple[int, int], np.ndarray] = {}

    async def ask(client: int, n: int) -> None:
        results[client, n] = await clients[client].embed(texts[n])

    try:
        async with anyio.create_task_group() as tg:
            for client in clients:
                await tg.start(client.run)
            async with anyio.create_task_group() as askers:
                for c in range(2):
                    for n in range(len(texts)):
                        askers.start_soon(ask, c, n)
            tg.cancel_scope.cancel()
    finally:
        server.kill()
        server.wait()
    assert all(np.allclose(v, bag_of_words(texts[n])) for (_, n), v in results.items())
    assert len(results) == 24
    # Some batch held requests of both clients (more than one client asked for).
    assert max(c.largest_batch for c in clients) > len(texts)


def _sidecar_pids(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent and b"fake_embed_server" in cmdline and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _wait(condition: object, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_supervisor_starts_its_sidecar_only_when_asked_and_restarts_it() -> None:
    sidecar = SharedSidecar(server=FAKE)
    try:
        assert os.stat(sidecar.directory).st_mode & 0o777 == 0o700
        sidecar.poll()
        time.sleep(0.3)
        assert not sidecar.started and _sidecar_pids(os.getpid()) == []
        os.write(sidecar.want_write, b"1")  # as a child's want_embedder does
        os.write(sidecar.want_write, b"1")
        sidecar.poll()
        sidecar.poll()
        _wait(lambda: len(_sidecar_pids(os.getpid())) == 1 and sidecar.socket_path.is_socket())
        (first,) = _sidecar_pids(os.getpid())
        os.kill(first, signal.SIGKILL)
        _wait(lambda: _sidecar_pids(os.getpid()) not in ([], [first]))
        assert len(_sidecar_pids(os.getpid())) == 1
    finally:
        sidecar.close()
    _wait(lambda: _sidecar_pids(os.getpid()) == [], 5)
    assert not sidecar.directory.exists()
