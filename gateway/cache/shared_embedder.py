"""One embedding sidecar for all of ``hedgerow gateway --processes N``.

MiniLM costs about 410 MB resident in its sidecar; one per gateway process
would cost GBs on a many-core host. So with N > 1 the supervisor owns the
only sidecar (``SharedSidecar``) and each child embeds through it
(``SocketEmbedder``); the server batches requests from every connection
together (``gateway.cache.embed_server``).

- The supervisor makes a private directory (0700) for the socket and starts
  nothing until a child asks: a child whose policy turns the semantic cache
  on writes a byte to a pipe it inherited (``want``), and the supervisor
  then runs a ``SidecarEmbedder`` on that socket in a thread of its own
  (same start, backoff and give-up policy as a single process's sidecar).
  A policy that later turns the semantic cache off stops the children's use
  of it, not the sidecar: it runs until the gateway stops.
- ``SocketEmbedder`` is ``SidecarEmbedder`` without a process: it connects to
  the socket, and while it cannot (the sidecar still loading, restarting, or
  given up) ``embed`` raises ``EmbedderBusy`` -- a cache miss, as always --
  and it tries again with a backoff.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from gateway.cache.embed_sidecar import _BROKEN, SERVER, SidecarEmbedder, _ChildLost, _Once

log = logging.getLogger("hedgerow.cache")

RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 2.0
STOP_POLL_S = 0.1


class SocketEmbedder(SidecarEmbedder):
    """Embeds through a sidecar another process runs on ``socket_path``."""

    def __init__(self, socket_path: Path, *, on_start: Callable[[], None] | None = None,
                 retry_initial_s: float = RETRY_INITIAL_S,
                 retry_max_s: float = RETRY_MAX_S) -> None:
        super().__init__(socket_path=socket_path)
        self.on_start = on_start  # tells the sidecar's owner it is wanted
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Stay connected until cancelled; started once it first is."""
        assert self.socket_path is not None
        if self.on_start is not None:
            self.on_start()
        announce = _Once(task_status.started)
        delay = self.retry_initial_s
        while True:
            try:
                stream = await anyio.connect_unix(self.socket_path)
            except OSError:  # loading, restarting or given up: its owner logs which
                await anyio.sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            try:
                async with stream:
                    self.starts += 1
                    delay = self.retry_initial_s
                    log.info("connected to the shared embedding sidecar")
                    await self._serve(None, stream, announce)
            except (_ChildLost, *_BROKEN) as error:
                log.warning("shared embedding sidecar: %s; reconnecting", error)
            finally:
                self._disconnected()
            await anyio.sleep(delay)


class SharedSidecar:
    """The supervisor's sidecar: started in a thread on the first ``want``."""

    def __init__(self, *, server: Sequence[str] = SERVER, threads: int = 1) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="hedgerow-embed-"))  # mode 0700
        self.socket_path = self.directory / "embed.sock"
        self.server = tuple(server)
        self.threads = threads
        self.want_read, self.want_write = os.pipe()  # children write a byte: "start it"
        os.set_blocking(self.want_read, False)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def poll(self) -> None:
        """Start the sidecar if a child has asked for it (called from the poll loop)."""
        try:
            wanted = os.read(self.want_read, 4096)
        except BlockingIOError:
            return
        if wanted and self._thread is None:
            log.info("semantic cache on: starting the gateway processes' shared embedding "
                     "sidecar (%s)", self.socket_path)
            self._thread = threading.Thread(target=anyio.run, args=(self._run,),
                                             name="embed-sidecar", daemon=True)
            self._thread.start()

    async def _run(self) -> None:
        embedder = SidecarEmbedder(server=self.server, threads=self.threads,
                                   socket_path=self.socket_path)
        async with anyio.create_task_group() as tg:
            tg.start_soon(embedder.run)
            while not self._stop.is_set():
                await anyio.sleep(STOP_POLL_S)
            tg.cancel_scope.cancel()  # kills and reaps the sidecar

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for fd in (self.want_read, self.want_write):
            os.close(fd)
        shutil.rmtree(self.directory, ignore_errors=True)
