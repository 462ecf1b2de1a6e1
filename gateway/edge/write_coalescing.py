"""Coalescing a connection's small writes into one TLS record and one syscall.

Hypercorn writes every piece of a response as soon as it is framed: over
HTTP/2 the HEADERS frame, each DATA frame and the END_STREAM frame are three
``transport.write`` calls (a TLS record and a ``send`` each), and the window
updates for the request another; with eight streams on a connection that is
dozens of tiny records per batch of requests. Profiled on cache hits, the
writes were the largest single cost (``StreamWriter.write`` 15% of the
gateway's CPU).

``CoalescingWriter`` stands in for the ``asyncio.StreamWriter`` hypercorn
gets for each TCP connection of a listener whose config names it as its
``wrap_writer`` (``hedgerow.http_stack.write_coalescing``): ``write`` only appends to a buffer and asks the
loop to flush it once the callbacks already queued have run (``call_soon``),
so everything the connection's tasks produce in one pass of the loop leaves
as one write. Nothing waits longer than that pass; with TCP_NODELAY the
bytes are on the wire in the same loop iteration. The buffer is bounded:
once it holds ``FLUSH_AT`` bytes it is written at once, so the transport's
high-water mark (what ``drain`` waits on) still sees every large body, and
closing flushes what is buffered before the connection ends.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hedgerow.http_stack import write_coalescing

FLUSH_AT = 64 * 1024


class CoalescingWriter:
    """An ``asyncio.StreamWriter`` whose writes leave once per loop pass."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._loop = asyncio.get_running_loop()
        self.writes = 0  # real writes, for tests

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        """Write what is buffered now (a no-op when nothing is)."""
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        if self._writer.transport.is_closing():
            return  # the peer is gone; hypercorn learns it from its reader
        self.writes += 1
        try:
            self._writer.write(data)
        except (ConnectionError, RuntimeError):
            pass  # closed under us: hypercorn's reader sees the end and closes

    async def drain(self) -> None:
        await self._writer.drain()  # what is still buffered here is under FLUSH_AT

    def write_eof(self) -> None:
        self.flush()
        self._writer.write_eof()

    def close(self) -> None:
        self.flush()
        self._writer.close()

    async def wait_closed(self) -> None:
        await self._writer.wait_closed()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, transport, is_closing ...
        return getattr(self._writer, name)


def install_write_coalescing() -> None:
    """Let listeners whose config has ``wrap_writer = CoalescingWriter`` use it; idempotent."""
    write_coalescing.install()
