"""An HTTP/3 client that leaves is told to the application
(``gateway.edge.quic_cap._client_left``), and what the application still sends
for it goes nowhere (the wrapped ``H3Protocol.stream_send``); a RESET_STREAM
alone is not leaving. Hypercorn's own ``H3Protocol`` with mocks around it."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import AsyncMock, Mock

import pytest
from aioquic.quic.events import ConnectionTerminated, StopSendingReceived, StreamReset
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config
from hypercorn.protocol.events import Body, StreamClosed
from hypercorn.protocol.h3 import H3Protocol
from hypercorn.typing import ConnectionState

from gateway.edge.quic_cap import install_quic_cap

pytestmark = pytest.mark.anyio


def _protocol() -> H3Protocol:
    install_quic_cap()
    protocol = H3Protocol(AsyncMock(), Config(), WorkerContext(None), AsyncMock(),
                          ConnectionState({}), None, None, Mock(), AsyncMock())
    protocol.connection = Mock(handle_event=Mock(return_value=[]))
    return protocol


def _stream() -> Any:
    stream = AsyncMock()
    stream.app_put = asyncio.Queue(10).put  # room: StreamClosed is queued
    return stream


async def test_stop_sending_closes_the_stream_for_its_application() -> None:
    protocol = _protocol()
    stream = protocol.streams[0] = _stream()
    await protocol.handle(StopSendingReceived(error_code=0x10C, stream_id=0))
    stream.handle.assert_awaited_once_with(StreamClosed(stream_id=0))
    assert 0 not in protocol.streams


async def test_a_reset_of_the_request_side_alone_is_not_leaving() -> None:
    # The client's answer to our own STOP_SENDING for a body nobody took, or a
    # request it stopped sending: the response is still wanted.
    protocol = _protocol()
    stream = protocol.streams[0] = _stream()
    await protocol.handle(StreamReset(error_code=0x100, stream_id=0))
    stream.handle.assert_not_awaited()
    assert 0 in protocol.streams


async def test_a_connection_that_ends_closes_every_stream() -> None:
    protocol = _protocol()
    streams = {0: _stream(), 4: _stream()}
    protocol.streams.update(streams)
    await protocol.handle(ConnectionTerminated(error_code=0, frame_type=None, reason_phrase=""))
    for stream_id, stream in streams.items():
        stream.handle.assert_awaited_once_with(StreamClosed(stream_id=stream_id))
    assert protocol.streams == {}


async def test_what_the_application_sends_after_its_client_left_goes_nowhere() -> None:
    protocol = _protocol()
    protocol.streams[0] = _stream()
    await protocol.stream_send(Body(stream_id=0, data=b"live"))
    protocol.connection.send_data.assert_called_once_with(0, b"live", False)
    await protocol.handle(StopSendingReceived(error_code=0x10C, stream_id=0))
    await protocol.stream_send(Body(stream_id=0, data=b"late"))  # aioquic would raise
    protocol.connection.send_data.assert_called_once()
