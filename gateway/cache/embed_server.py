"""The embedding sidecar: all-MiniLM-L6-v2 and the cache's pair model in their own process.

    python -m gateway.cache.embed_server --socket PATH [--threads N]

The gateway (``gateway.cache.embed_sidecar.SidecarEmbedder``) starts this so
that the model (ONNX Runtime; torch in earlier versions) never loads into its event-loop process:
with them loaded, every idle connection cost the gateway several times more
memory, and encoding competed with the event loop for the GIL.

Startup: load the model with ``load_minilm``, encode once to pay lazy
initialisation, bind the socket, then write ``ready <dim>`` on stdout (the
only thing written there; anything a library prints goes to stderr). A model
that cannot load (no ONNX export yet, ``hedgerow[cache]`` not installed)
writes ``no-model <why and how to fix it>`` instead and exits with
``EXIT_NO_MODEL``; the gateway logs that line and serves without the
semantic cache. Frames
are those of ``gateway.cache.embed_wire``. Requests from every connection
join one bounded queue; while one batch encodes on a thread the next one
gathers, so batches grow exactly when load does (as in ``MiniLmEmbedder``):
the batch's embeds in one model call, its judgements in one call of the pair
model (``gateway.cache.pair_model``). The pair model is loaded too when it has
been exported; without it the server still embeds, says why once in its log,
and answers every judge request FAILED (a miss for the cache).

The server lives only as long as its parent: it exits when stdin reaches EOF
(the parent's end of the pipe closes when the parent dies, however it dies)
and asks the kernel for SIGKILL when the parent exits (PR_SET_PDEATHSIG).
It ignores SIGINT: a Ctrl-C in the gateway's terminal is the gateway's to
handle, and the gateway stops this process when it shuts down.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from gateway.cache.embed_wire import (
    EMBED,
    EXIT_NO_MODEL,
    MAX_LINE_BYTES,
    NO_MODEL_LINE,
    READY_LINE,
    EmbedRequest,
    ProtocolError,
    failure_frame,
    floats_frame,
    read_request,
)
from gateway.cache.embedder import DIM, MAX_BATCH, MAX_PENDING, encode, load_minilm, next_batch
from gateway.cache.pair_model import judge_many, load_pair_model

log = logging.getLogger("hedgerow.embed-server")

PR_SET_PDEATHSIG = 1
_CONNECTION_GONE = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                    anyio.ClosedResourceError, ProtocolError, OSError)


class _Connection:
    """One client connection's write side; a lock keeps frames whole."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.lock = anyio.Lock()

    async def send(self, data: bytes) -> None:
        try:
            async with self.lock:
                await self.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the client went away; its requests need no answer


@dataclass(frozen=True)
class _Job:
    request: EmbedRequest
    reply_to: _Connection


NO_PAIR_MODEL = "no pair model in this sidecar"


class EmbedServer:
    def __init__(self, model: Any, pair_model: Any = None, *, max_batch: int = MAX_BATCH,
                 max_queued: int = MAX_PENDING) -> None:
        self.model = model
        self.pair_model = pair_model  # None: judge requests fail (a miss)
        self.max_batch = max_batch
        self._send, self._receive = anyio.create_memory_object_stream[_Job](max_queued)
        self.batches = 0

    async def handle(self, stream: SocketStream) -> None:
        """Read one connection's requests into the shared queue until it closes."""
        connection = _Connection(stream)
        frames = BufferedByteReceiveStream(stream)
        async with stream:
            try:
                while True:
                    request = await read_request(frames)
                    try:
                        self._send.send_nowait(_Job(request, connection))
                    except anyio.WouldBlock:
                        await connection.send(failure_frame(request.request_id, "queue full"))
            except _CONNECTION_GONE as error:
                log.debug("connection closed: %r", error)

    async def serve_batches(self) -> None:
        while True:
            await self._answer(await next_batch(self._receive, self.max_batch))

    async def _answer(self, batch: list[_Job]) -> None:
        replies: dict[_Connection, list[bytes]] = defaultdict(list)
        embeds = [job for job in batch if job.request.op == EMBED]
        judges = [job for job in batch if job.request.op != EMBED]
        if judges and self.pair_model is None:
            for job in judges:
                replies[job.reply_to].append(failure_frame(job.request.request_id, NO_PAIR_MODEL))
            judges = []
        try:
            vectors, scores = await anyio.to_thread.run_sync(self._compute, embeds, judges)
        except (RuntimeError, ValueError) as error:  # a model failure fails this batch only
            log.warning("a batch of %d embeds and %d judgements failed: %s",
                        len(embeds), len(judges), error)
            for job in (*embeds, *judges):
                replies[job.reply_to].append(failure_frame(job.request.request_id, str(error)))
        else:
            for row, job in enumerate(embeds):
                replies[job.reply_to].append(
                    floats_frame(job.request.request_id, vectors[row], len(batch)))
            at = 0
            for job in judges:
                count = len(job.request.texts) - 1
                replies[job.reply_to].append(
                    floats_frame(job.request.request_id, scores[at:at + count], len(batch)))
                at += count
        self.batches += 1
        for connection, frames in replies.items():
            await connection.send(b"".join(frames))

    def _compute(self, embeds: list[_Job], judges: list[_Job]) -> tuple[Any, Any]:
        """(vectors, scores) of a batch, each with one model call (blocking: a thread)."""
        vectors = encode(self.model, [job.request.texts[0] for job in embeds]) if embeds else None
        pairs = [(job.request.texts[0], cached) for job in judges
                 for cached in job.request.texts[1:]]
        scores = judge_many(self.pair_model, pairs) if pairs else None
        return vectors, scores


async def serve(model: Any, pair_model: Any, socket_path: Path, ready_fd: int) -> None:
    """Bind, say ready, serve until killed."""
    server = EmbedServer(model, pair_model)
    if socket_path.is_socket():
        socket_path.unlink()  # left by a predecessor that was killed
    listener = await anyio.create_unix_listener(socket_path)
    os.chmod(socket_path, 0o600)
    with os.fdopen(ready_fd, "wb") as ready:
        ready.write(READY_LINE + f" {DIM}\n".encode())
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(server.serve_batches)
        await listener.serve(server.handle)


def _die_with_parent() -> None:
    """Exit when the parent does: SIGKILL from the kernel, and EOF on stdin."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: stdin EOF still ends this process
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)

    def wait_for_eof() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered
        # reader makes interpreter shutdown abort.
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass  # no stdin at all: the same as EOF
        os._exit(0)  # the parent closed its end or died: no orphan stays behind

    threading.Thread(target=wait_for_eof, name="parent-watch", daemon=True).start()


def _pair_model(threads: int) -> Any:
    """The pair model, warmed up; None (said once, here) when it cannot load."""
    try:
        pair_model = load_pair_model(threads)
        judge_many(pair_model, [("warm up", "warm up")])
    except (ImportError, OSError) as error:
        log.warning("semantic cache: no pair model, so every semantic lookup misses: %s",
                    " ".join(str(error).split()))
        return None
    log.info("semantic cache: pair model loaded")
    return pair_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.cache.embed_server")
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    ready_fd = os.dup(1)
    os.dup2(2, 1)  # stdout carries only the ready line
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no bars in the gateway's log
    started = time.monotonic()
    try:
        model = load_minilm(args.threads)
        encode(model, ["warm up"])  # pay lazy initialisation before saying ready
    except (ImportError, OSError) as error:
        # Said once, by the gateway, which reads it here (a person running this
        # by hand sees it on stdout): the export or the extra is missing.
        why = " ".join(str(error).split()).encode()[:MAX_LINE_BYTES - 16]
        with os.fdopen(ready_fd, "wb") as ready:
            ready.write(NO_MODEL_LINE + b" " + why + b"\n")
        return EXIT_NO_MODEL
    log.info("embedding model loaded in %.1fs (pid %d, %d thread(s))",
             time.monotonic() - started, os.getpid(), args.threads)
    anyio.run(serve, model, _pair_model(args.threads), args.socket, ready_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
