"""HTTP/3 (QUIC) connections count against the same cap as TCP ones.

Hypercorn's ``QuicProtocol`` makes a connection (and starts its TLS handshake)
for every Initial packet with an unknown destination connection id, without
limit. ``install_quic_cap`` puts the ``ConnectionCap`` in force
(``ACTIVE_CAP``, set by ``gateway.transport.serve``) in front of that: an
Initial that would open a connection beyond the cap is dropped before any
QUIC or TLS work (the client's handshake times out, as for a lost packet) and
counted as a refusal; the slot a QUIC connection holds is given back when it
terminates (closed by either side or idle). Packets of connections already
open are never looked at twice: only long-header packets are parsed here,
and those only until the handshake is done.
"""

from __future__ import annotations

from typing import Any

from aioquic.buffer import Buffer
from aioquic.quic.packet import PACKET_TYPE_INITIAL, pull_quic_header
from hypercorn.events import RawData
from hypercorn.protocol.quic import QuicProtocol

from gateway.connection_cap import ACTIVE_CAP, ConnectionCap, log_refusals

_ORIGINAL = "_hedgerow_uncapped"
_LONG_HEADER = 0x80


def install_quic_cap() -> None:
    """Patch ``QuicProtocol`` in place; idempotent."""
    if hasattr(QuicProtocol, _ORIGINAL):
        return
    handle, handle_events = QuicProtocol.handle, QuicProtocol._handle_events
    setattr(QuicProtocol, _ORIGINAL, (handle, handle_events))

    async def capped_handle(self: Any, event: Any) -> None:
        cap = _cap(self)
        new_cid = _new_connection_id(self, event) if cap is not None else None
        if new_cid is None:
            await handle(self, event)
            return
        assert cap is not None
        if not cap.try_open():
            log_refusals(cap)
            return  # dropped: no connection, no handshake
        await handle(self, event)
        created = self.connections.get(new_cid)
        if created is not None:
            self._hedgerow_counted.add(id(created))
        else:  # too short, or the server is shutting down: nothing was opened
            cap.close()

    async def counted_handle_events(self: Any, connection: Any, client: Any = None) -> None:
        await handle_events(self, connection, client)
        counted = getattr(self, "_hedgerow_counted", None)
        if counted and not connection.cids and id(connection) in counted:
            counted.discard(id(connection))  # terminated: its ids are forgotten
            cap = _cap(self)
            if cap is not None:
                cap.close()

    QuicProtocol.handle = capped_handle  # type: ignore[method-assign]
    QuicProtocol._handle_events = counted_handle_events  # type: ignore[method-assign]


def _cap(protocol: Any) -> ConnectionCap | None:
    """The cap of the server this protocol belongs to, fixed at its first packet."""
    try:
        return protocol._hedgerow_cap  # type: ignore[no-any-return]
    except AttributeError:
        protocol._hedgerow_cap = ACTIVE_CAP.get()
        protocol._hedgerow_counted = set()
        return protocol._hedgerow_cap  # type: ignore[no-any-return]


def _new_connection_id(protocol: Any, event: Any) -> bytes | None:
    """The destination id of an Initial packet for a connection this server does
    not know (the id hypercorn files the new connection under); else None."""
    data = event.data if isinstance(event, RawData) else b""
    if not data or not data[0] & _LONG_HEADER:
        return None  # short header: an established connection's packet
    try:
        header = pull_quic_header(Buffer(data=data), host_cid_length=8)
    except ValueError:
        return None  # hypercorn drops it too
    if header.packet_type != PACKET_TYPE_INITIAL or header.destination_cid in protocol.connections:
        return None
    return bytes(header.destination_cid)
