"""The coalescing writer: one real write per loop pass, nothing lost or reordered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.edge.write_coalescing import FLUSH_AT, CoalescingWriter

pytestmark = pytest.mark.anyio


class Pair:
    def __init__(self) -> None:
        self.accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.Queue())

    async def open(self) -> tuple[CoalescingWriter, asyncio.StreamReader]:
        server = await asyncio.start_server(
            lambda r, w: self.accepted.put_nowait((r, w)), "127.0.0.1", 0)
        self.server = server
        port = server.sockets[0].getsockname()[1]
        client_reader, self.client_writer = await asyncio.open_connection("127.0.0.1", port)
        _, server_writer = await self.accepted.get()
        self.server_writer = server_writer
        return CoalescingWriter(server_writer), client_reader

    async def close(self) -> None:
        self.client_writer.close()
        self.server_writer.close()
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[CoalescingWriter, asyncio.StreamReader]]:
    sockets = Pair()
    yield await sockets.open()
    await sockets.close()


async def test_writes_in_one_loop_pass_leave_as_one_write_in_order(
        pair: tuple[CoalescingWriter, asyncio.StreamReader]) -> None:
    writer, reader = pair
    for i in range(10):
        writer.write(b"frame%d;" % i)
    assert writer.writes == 0  # nothing on the wire before the loop turns
    await asyncio.sleep(0)
    assert writer.writes == 1
    expected = b"".join(b"frame%d;" % i for i in range(10))
    assert await reader.readexactly(len(expected)) == expected


async def test_writes_in_separate_passes_are_not_held_back(
        pair: tuple[CoalescingWriter, asyncio.StreamReader]) -> None:
    writer, reader = pair
    writer.write(b"first")
    await writer.drain()
    await asyncio.sleep(0)
    assert await reader.readexactly(5) == b"first"  # arrives without a second write
    writer.write(b"second")
    await asyncio.sleep(0)
    assert writer.writes == 2
    assert await reader.readexactly(6) == b"second"


async def test_a_large_buffer_is_written_at_once(
        pair: tuple[CoalescingWriter, asyncio.StreamReader]) -> None:
    writer, reader = pair
    writer.write(b"x" * (FLUSH_AT - 1))
    assert writer.writes == 0
    writer.write(b"y")
    assert writer.writes == 1  # bounded: no waiting for the loop once FLUSH_AT is reached
    data = await reader.readexactly(FLUSH_AT)
    assert data.endswith(b"xy")


async def test_close_flushes_what_is_buffered_before_the_end(
        pair: tuple[CoalescingWriter, asyncio.StreamReader]) -> None:
    writer, reader = pair
    writer.write(b"last words")
    writer.close()
    await writer.wait_closed()
    assert await reader.read() == b"last words"  # then EOF


async def test_writes_after_the_peer_left_are_dropped_quietly(
        pair: tuple[CoalescingWriter, asyncio.StreamReader]) -> None:
    writer, _ = pair
    writer.close()
    writer.write(b"too late")
    await asyncio.sleep(0)  # the scheduled flush finds the transport closing: no error
    assert writer.writes == 0
