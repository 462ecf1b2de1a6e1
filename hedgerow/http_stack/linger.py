"""A connection the server cuts lingers until its client has stopped sending.

Changes: hypercorn's ``TCPServer._read_data`` and ``TCPServer.protocol_send``
(``hypercorn/asyncio/tcp_server.py``, hypercorn 0.18.0; ``_read_data`` is
wrapped by ``eof`` too, the two wrappers chained). ``_read_data`` notes the
task reading the connection; when that task -- handling the client's bytes
-- has the protocol end the connection (``Closed``: an HTTP/2 GOAWAY for a
protocol error such as a header list over its limit, an HTTP/1.1 4xx for a
malformed or oversized head), the client's further bytes are read and dropped until it
closes, until nothing has come for ``LINGER_IDLE_S``, or ``LINGER_MAX_S`` in
all; then hypercorn closes the connection as before. The cost: a client
that waits for the server to close, rather than closing once it has read the
GOAWAY or the ``connection: close`` 4xx, sees the end that much later. nginx's
``lingering_close`` does the same (its ``lingering_timeout`` 5 s,
``lingering_time`` 30 s).

Why: hypercorn closes at once. Over TLS the close still reads and drops the
client's bytes, but only while it waits for the client's close_notify:
``TLS_SHUTDOWN_TIMEOUT_S`` (1 s, ``hedgerow.connection_cap``), after which
the socket is closed. A client still sending its request then -- an HTTP/2
client whose header block was refused, with its body still to write, held up
by a busy machine for over a second -- had its next write fail (httpx:
``WriteError``, "EOF occurred in violation of protocol") and never read the
GOAWAY (ENHANCE_YOUR_CALM) or the 4xx already waiting in its receive buffer:
it could not tell a refusal from a network fault. Seen as a flaky
``tests/faults/test_fault_slow_clients.py`` under load; reproduced every
time with a body sent 1.2 s after the headers.

Closes from other tasks (a drained HTTP/2 connection after its last
END_STREAM, an HTTP/1.1 response without keep-alive, the keep-alive timer)
do not linger: the client has sent its requests, and the reading task is
still reading. Nor does a close sent inside ``at_once()``: the HTTP/2
guard's cut of a flood (``gateway.edge.h2_guard``), whose sender is not
owed an answer and whose further bytes would only cost decryption. Any
other cut client keeps its connection at most ``LINGER_MAX_S``, sending
into a void; a cancelled connection task (server shutdown) stops lingering
at once.

If the internals moved: ``PatchError`` at install when ``TCPServer`` has no
``_read_data`` or ``protocol_send``; ``reader`` is read from the
instance (set by its ``__init__``; ``tests/unit/test_http_stack_linger.py``).

Scope: process (every hypercorn TCP connection; it is a bug fix).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from hypercorn.asyncio.tcp_server import MAX_RECV, TCPServer
from hypercorn.events import Closed

from hedgerow.http_stack.patch import require, wrap

NAME = "linger"
_READER_TASK = "_hedgerow_reader_task"
_AT_ONCE: ContextVar[bool] = ContextVar("hedgerow_close_at_once", default=False)

# A client that sends nothing for this long after the cut is taken to have
# stopped; the TLS close then waits TLS_SHUTDOWN_TIMEOUT_S more for its
# close_notify. A client stalled up to their sum (3 s, was 1 s) between two
# writes still reads the refusal; one that waits for the server to close
# instead of closing after the GOAWAY or the 4xx waits as long (nginx's
# lingering_timeout is 5 s; shorter here: every second a cut abuser holds).
LINGER_IDLE_S = 2.0
# However much it keeps sending, a cut client is closed after this long
# (nginx: lingering_time 30 s; shorter here: a cut is often an abuser's).
LINGER_MAX_S = 10.0


def install() -> None:
    """Idempotent."""
    require(TCPServer, "_read_data", "protocol_send", patch=NAME)

    def make_read_data(original: Callable[..., Awaitable[None]]
                       ) -> Callable[..., Awaitable[None]]:
        async def read_data(self: Any, *args: Any, **kwargs: Any) -> None:
            setattr(self, _READER_TASK, asyncio.current_task())
            await original(self, *args, **kwargs)
        return read_data

    def make_protocol_send(original: Callable[..., Awaitable[None]]
                           ) -> Callable[..., Awaitable[None]]:
        async def protocol_send(self: Any, event: Any, *args: Any, **kwargs: Any) -> None:
            if (isinstance(event, Closed) and not _AT_ONCE.get()
                    and getattr(self, _READER_TASK, None) is asyncio.current_task()):
                await linger(self.reader, LINGER_IDLE_S, LINGER_MAX_S)
            await original(self, event, *args, **kwargs)
        return protocol_send

    wrap(TCPServer, "_read_data", make_read_data, patch=NAME)
    wrap(TCPServer, "protocol_send", make_protocol_send, patch=NAME)


@contextmanager
def at_once() -> Iterator[None]:
    """A ``Closed`` the protocol sends in here closes without lingering."""
    token = _AT_ONCE.set(True)
    try:
        yield
    finally:
        _AT_ONCE.reset(token)


async def linger(reader: asyncio.StreamReader, idle_s: float, max_s: float) -> None:
    """Read and drop what the client still sends: until it closes, is silent
    for ``idle_s``, or ``max_s`` has passed. Awaiting the first read also lets
    the loop flush what the protocol wrote last (the GOAWAY, the 4xx)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    while not reader.at_eof():
        wait = min(idle_s, deadline - loop.time())
        if wait <= 0:
            return
        try:
            if not await asyncio.wait_for(reader.read(MAX_RECV), wait):
                return  # EOF: the client closed after reading the answer
        except (TimeoutError, OSError, ssl.SSLError):
            return  # silent, or gone
