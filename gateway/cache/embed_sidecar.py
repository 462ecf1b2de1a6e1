"""The gateway's embedder and pair judge: MiniLM in a supervised sidecar process.

``SidecarEmbedder`` implements the ``Embedder`` and ``PairJudge`` protocols
without loading a model into the gateway: ``run`` starts ``python -m
gateway.cache.embed_server`` (same interpreter, same virtualenv) with its Unix
socket in a private temp directory, waits for its ``ready`` line, connects
once and multiplexes every concurrent ``embed`` and ``judge`` over that
connection by request id (the server batches them). Why a process: with torch in the gateway an idle connection cost
several times more memory and encoding competed with the event loop for the
GIL (docs/reliability.md).

Failure is a cache miss, never a failed request: ``embed`` and ``judge``
raise ``EmbedderBusy`` at once when the sidecar is not ready or
``max_pending`` requests already wait (and ``judge`` when the sidecar answers
FAILED, having no pair model: ``judge_failures`` counts only those); if the child dies or the socket breaks, every pending
embed fails with ``EmbedderBusy``, ``ready`` goes False and the child is
started again after a backoff (``RestartTracker``; the reason is logged).
Too many deaths in a row, or a model that cannot be loaded at all, turn the
semantic cache off for this process's life. Cancelling ``run`` kills and
reaps the child; if the gateway itself is killed, the child sees EOF on its
stdin (and PR_SET_PDEATHSIG) and exits.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NoReturn

import anyio
import numpy as np
from anyio.abc import ByteReceiveStream, Process, SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from gateway.cache.embed_wire import (
    EXIT_NO_MODEL,
    MAX_LINE_BYTES,
    NO_MODEL_LINE,
    READY_LINE,
    ProtocolError,
    floats_of,
    judge_frame,
    read_response,
    request_frame,
)
from gateway.cache.embedder import DIM, MAX_PENDING, EmbedderBusy
from hedgerow.actors import RestartPolicy, RestartTracker

log = logging.getLogger("hedgerow.cache")

START_TIMEOUT_S = 180.0  # loading the model on a busy machine takes tens of seconds
EXIT_GRACE_S = 1.0  # after its stdin closes, how long the child may take to exit before a kill
RESTARTS = RestartPolicy(backoff_initial=0.5, backoff_max=30.0, reset_after=60.0,
                         max_restarts=5, window=300.0)
SERVER = ("-m", "gateway.cache.embed_server")
_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_BROKEN = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
           anyio.ClosedResourceError, ProtocolError, OSError)


@dataclass
class _Waiter:
    floats: int  # in the answer: the vector's dimension, or one score per cached question
    done: anyio.Event = field(default_factory=anyio.Event)
    values: np.ndarray | None = None
    error: str = "embedding failed"
    answered_failed: bool = False  # the sidecar itself said FAILED (not refused, not lost)


class _ChildLost(Exception):
    """The sidecar stopped serving; the message says why."""


class _NoModel(_ChildLost):
    """The sidecar cannot load the model here: starting it again will not help."""


class _Once:
    """Calls ``started`` the first time only (a restarted child is not news)."""

    def __init__(self, started: Callable[[], None]) -> None:
        self._started: Callable[[], None] | None = started

    def __call__(self) -> None:
        started, self._started = self._started, None
        if started is not None:
            started()


class SidecarEmbedder:
    dim = DIM

    def __init__(self, *, threads: int = 1, max_pending: int = MAX_PENDING,
                 start_timeout_s: float = START_TIMEOUT_S,
                 restart_policy: RestartPolicy = RESTARTS,
                 server: Sequence[str] = SERVER, socket_path: Path | None = None) -> None:
        self.threads = threads
        # None: a socket in a private temporary directory; given (``--processes N``'s
        # supervisor, in a 0700 directory of its own): other processes connect there too.
        self.socket_path = socket_path
        self.server = tuple(server)  # the child's arguments to python (tests run a twin)
        self.max_pending = max_pending
        self.start_timeout_s = start_timeout_s
        self.restart_policy = restart_policy
        self.ready = False
        self.pid: int | None = None  # the child's, while one runs
        self.starts = 0
        self.embedded = 0
        self.refused = 0
        self.lost = 0  # embeds failed because the child died or the socket broke
        self.judged = 0
        # Judgements the sidecar answered FAILED (no pair model, or it failed on the
        # batch); refusals and losses are counted in ``refused`` and ``lost`` only.
        self.judge_failures = 0
        self.largest_batch = 0  # the most texts the sidecar encoded in one model call
        self._pending: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        self._outbox: MemoryObjectSendStream[bytes] | None = None

    # -- the Embedder protocol --------------------------------------------

    async def embed(self, text: str) -> np.ndarray:
        vector = await self._ask(lambda request_id: request_frame(request_id, text), self.dim)
        self.embedded += 1
        return vector

    async def judge(self, question: str, cached: Sequence[str]) -> np.ndarray:
        """How surely each cached question asks what ``question`` asks (0..1)."""
        scores = await self._ask(lambda request_id: judge_frame(request_id, question, cached),
                                 len(cached), on_failed=self._judge_failed)
        self.judged += 1
        return scores

    def _judge_failed(self) -> None:
        self.judge_failures += 1

    async def _ask(self, frame: Callable[[int], bytes], floats: int,
                   on_failed: Callable[[], None] | None = None) -> np.ndarray:
        outbox = self._outbox
        if not self.ready or outbox is None:
            self._refuse("embedding sidecar not ready")
        if len(self._pending) >= self.max_pending:
            self._refuse("embedding queue full")
        request_id = next(self._ids)
        waiter = self._pending[request_id] = _Waiter(floats)
        try:
            outbox.send_nowait(frame(request_id))
            await waiter.done.wait()
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._refuse("embedding sidecar unavailable")
        finally:
            self._pending.pop(request_id, None)  # also when cancelled: a late answer is dropped
        if waiter.values is None:
            if waiter.answered_failed and on_failed is not None:
                on_failed()
            raise EmbedderBusy(waiter.error)
        return waiter.values

    def _refuse(self, why: str) -> NoReturn:
        self.refused += 1
        raise EmbedderBusy(why)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep a sidecar serving until cancelled; started once it first is ready."""
        tracker = RestartTracker(self.restart_policy)
        announce = _Once(task_status.started)
        with tempfile.TemporaryDirectory(prefix="hedgerow-embed-") as directory:
            socket_path = self.socket_path or Path(directory) / "embed.sock"
            while True:
                started_at = time.monotonic()
                try:
                    await self._serve_one_child(socket_path, announce)
                except _NoModel as error:
                    log.error("semantic cache off: the embedding sidecar %s", error)
                    return
                except _ChildLost as lost:
                    delay = tracker.on_crash(now=time.monotonic(), started_at=started_at)
                    if delay is None:
                        log.error("semantic cache off: the embedding sidecar %s, "
                                  "too often (%s)", lost, self.restart_policy)
                        return
                    log.warning("embedding sidecar %s; restarting it in %.1fs", lost, delay)
                    await anyio.sleep(delay)

    # -- one child's life -------------------------------------------------

    async def _serve_one_child(self, socket_path: Path, announce: _Once) -> None:
        """Start a child and serve through it; raises _ChildLost when it stops."""
        try:
            process = await anyio.open_process(self._command(socket_path), stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=None,
                                               env=_child_env())
        except OSError as error:
            raise _ChildLost(f"could not be started: {error}") from None
        self.pid = process.pid
        try:
            await self._await_ready(process)
            async with await anyio.connect_unix(socket_path) as stream:
                self.starts += 1
                log.info("embedding sidecar ready (pid %d)", process.pid)
                await self._serve(process, stream, announce)
        except _BROKEN as error:
            raise _ChildLost(f"(pid {process.pid}) lost its connection: {error!r}") from None
        finally:
            await self._stop(process)

    def _command(self, socket_path: Path) -> list[str]:
        return [sys.executable, *self.server, "--socket", str(socket_path),
                "--threads", str(self.threads)]

    async def _await_ready(self, process: Process) -> None:
        assert process.stdout is not None
        with anyio.move_on_after(self.start_timeout_s):
            line = await _first_line(process.stdout)
            if line.startswith(READY_LINE):
                return
            code = await process.wait()
            if code == EXIT_NO_MODEL:
                why = line.removeprefix(NO_MODEL_LINE).strip().decode(errors="replace")
                raise _NoModel(f"cannot load all-MiniLM-L6-v2: {why or 'see its log'}")
            raise _ChildLost(f"(pid {process.pid}) exited with status {code} while loading")
        raise _ChildLost(f"(pid {process.pid}) was not ready within {self.start_timeout_s:.0f}s")

    async def _serve(self, process: Process | None, stream: SocketStream,
                     announce: _Once) -> None:
        """Serve every embed over ``stream`` until it breaks (or ``process``, if ours, exits)."""
        send, receive = anyio.create_memory_object_stream[bytes](self.max_pending)
        reason = "stopped"
        async with anyio.create_task_group() as tg:

            async def until_lost(what: str, job: Callable[[], Awaitable[object]]) -> None:
                nonlocal reason
                try:
                    await job()
                    reason = what
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    reason = "closed its connection"
                except _BROKEN as error:
                    reason = f"broke its connection: {error!r}"
                tg.cancel_scope.cancel()

            if process is not None:
                tg.start_soon(until_lost, "exited", process.wait)
            tg.start_soon(until_lost, "stopped reading", partial(self._write, stream, receive))
            tg.start_soon(until_lost, "stopped answering", partial(self._read, stream))
            self._outbox = send
            self.ready = True
            announce()
        raise _ChildLost(f"(pid {process.pid}) {reason}" if process else reason)

    async def _write(self, stream: SocketStream, outbox: MemoryObjectReceiveStream[bytes]) -> None:
        async with outbox:
            async for frame in outbox:
                frames = [frame]
                while True:  # whatever queued meanwhile goes in the same write
                    try:
                        frames.append(outbox.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await stream.send(b"".join(frames))

    async def _read(self, stream: SocketStream) -> None:
        frames = BufferedByteReceiveStream(stream)
        while True:
            response = await read_response(frames)
            waiter = self._pending.get(response.request_id)
            if waiter is None:
                continue  # its embed was cancelled (timed out) meanwhile
            if response.ok:
                waiter.values = floats_of(response, waiter.floats)
                self.largest_batch = max(self.largest_batch, response.batch)
            else:
                waiter.error = response.payload.decode("utf-8", errors="replace")
                waiter.answered_failed = True
            waiter.done.set()

    def _disconnected(self) -> None:
        """No more embeds through this connection; fail what waits on it."""
        self.ready = False
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None
        self._fail_pending("embedding sidecar lost")

    async def _stop(self, process: Process) -> None:
        """Fail what waits, then make sure the child is gone and reaped."""
        self._disconnected()
        with anyio.CancelScope(shield=True):
            if process.stdin is not None:
                await process.stdin.aclose()  # EOF: the child exits by itself at once
            with anyio.move_on_after(EXIT_GRACE_S):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            log.info("embedding sidecar (pid %d) ended with status %s",
                     process.pid, process.returncode)
            await process.aclose()
        self.pid = None

    def _fail_pending(self, why: str) -> None:
        self.lost += len(self._pending)
        for waiter in self._pending.values():
            waiter.error = why
            waiter.done.set()
        self._pending.clear()


async def _first_line(stdout: ByteReceiveStream) -> bytes:
    """The child's first line (b"" if it ends before writing one)."""
    buffered = BufferedByteReceiveStream(stdout)
    try:
        return await buffered.receive_until(b"\n", MAX_LINE_BYTES)
    except (anyio.IncompleteRead, anyio.EndOfStream, anyio.DelimiterNotFound):
        return b""


def _child_env() -> dict[str, str]:
    """The gateway's environment, with this checkout importable whatever the cwd."""
    env = dict(os.environ)
    paths = [str(_PROJECT_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
