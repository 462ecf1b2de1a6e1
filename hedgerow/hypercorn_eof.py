"""A closed connection must not wait out its keep-alive timer (hypercorn 0.18).

When a client closes its connection, hypercorn's ``TCPServer`` reads EOF and
tells the protocol, but the HTTP/1.1 protocol only ends its stream; the
connection's keep-alive timer task (``_idle_timeout``) keeps running, and the
connection's task group cannot finish until it fires. So every connection a
client closed held three tasks and its buffers for the whole
``keep_alive_timeout``: 5 s on the gateway's public port, 75 s on the
internal servers (control plane, workers, the admin listeners). Fifty
``GET /admin/cache`` calls left 150 tasks behind for over a minute.

``install_eof_fix`` stops the timer once the reader has seen EOF; whatever the
app is still sending for a request already read carries on. Idempotent.
"""

from __future__ import annotations

from typing import Any

from hypercorn.asyncio.tcp_server import TCPServer

_ORIGINAL = "_hedgerow_original_read_data"


def install_eof_fix() -> None:
    if hasattr(TCPServer, _ORIGINAL):
        return
    original = TCPServer._read_data
    setattr(TCPServer, _ORIGINAL, original)

    async def read_data(self: Any) -> None:
        await original(self)
        await self.idle_task.stop()  # EOF: nothing left to keep alive

    TCPServer._read_data = read_data  # type: ignore[method-assign]
