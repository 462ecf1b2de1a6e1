"""HTTP/3 connections take slots of the gateway's connection cap too.

A gateway capped at 3 connections holds three QUIC connections; a fourth
client's Initial packets are dropped before any handshake work (its connect
times out) and counted as refusals. Once one of the three closes, its slot is
free again and a new HTTP/3 request is served.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack

import anyio
import pytest
from aioquic.asyncio import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from prometheus_client.parser import text_string_to_metric_families

from tests.support.capped import start_capped_stack
from tests.support.h3client import h3_request
from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

CAP = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_capped_stack(tmp_path_factory.mktemp("quic-cap"), CAP)
    try:
        yield stack
    finally:
        stack.stop_all()


def _port(stack: Stack) -> int:
    return int(stack.gateway_url.rsplit(":", 1)[1])


def _configuration(stack: Stack) -> QuicConfiguration:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN,
                                      server_name="127.0.0.1", idle_timeout=30.0)
    configuration.load_verify_locations(cafile=str(stack.ca_cert))
    return configuration


def _answered(stack: Stack, wait_s: float) -> int:
    """Send a new client's Initial packets (aioquic's sans-IO connection on a
    plain UDP socket) and count the datagrams that come back within ``wait_s``."""
    quic = QuicConnection(configuration=_configuration(stack))
    address = ("127.0.0.1", _port(stack))
    quic.connect(address, now=time.monotonic())
    answers = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for datagram, _ in quic.datagrams_to_send(now=time.monotonic()):
            udp.sendto(datagram, address)
        udp.settimeout(wait_s)
        try:
            while True:
                udp.recvfrom(65536)
                answers += 1
        except TimeoutError:
            return answers


async def _connections(stack: Stack) -> dict[str, float]:
    def scrape() -> dict[str, float]:
        text = stack.gateway_metrics()  # the admin listener: no slot of the cap taken
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name.startswith("hedgerow_connections")}
    return await anyio.to_thread.run_sync(scrape)


async def _until(stack: Stack, predicate: object, timeout_s: float = 10.0) -> dict[str, float]:
    with anyio.fail_after(timeout_s):
        while True:
            seen = await _connections(stack)
            if predicate(seen):  # type: ignore[operator]
                return seen
            await anyio.sleep(0.2)


async def test_quic_connections_count_against_the_cap_and_free_their_slot(
        stack: Stack) -> None:
    refused_before = (await _connections(stack))["hedgerow_connections_refused_total"]
    async with AsyncExitStack() as held:
        quic = []
        for _ in range(CAP):
            quic.append(await held.enter_async_context(
                connect("127.0.0.1", _port(stack), configuration=_configuration(stack))))
        # A fourth client's Initials are dropped: no answer at all, no handshake.
        assert await anyio.to_thread.run_sync(_answered, stack, 1.5) == 0
        quic[0].close()
        await quic[0].wait_closed()
        # The closed connection's slot comes back (the server's close takes a moment).
        response = None
        with anyio.fail_after(15):
            while response is None:
                try:
                    response = await h3_request("127.0.0.1", _port(stack), path="/healthz",
                                                cafile=stack.ca_cert, timeout_s=1.5,
                                                ticket_wait_s=0)
                except TimeoutError:
                    await anyio.sleep(0.2)
        assert response.status == 200
    seen = await _until(stack, lambda m: m["hedgerow_connections_open"] == 0)
    assert seen["hedgerow_connections_refused_total"] > refused_before  # the dropped Initials
