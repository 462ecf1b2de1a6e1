"""``http_stack.udp_server``: every datagram is screened before hypercorn's
queue, and a QUIC listener shuts down at once, not after graceful_timeout."""

from __future__ import annotations

import socket
import time
from typing import Any

import anyio
import hypercorn.asyncio.run
import pytest

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.transport import QUIC_SESSION_TICKETS, install_hypercorn_patches
from hedgerow.http_stack.udp_server import UDP_QUEUE_DATAGRAMS, ScreenedUDPServer
from tests.support.http_stack import gateway_listener

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("state"))


async def test_datagrams_are_screened_and_shutdown_does_not_wait(
        cert: DevCertificate, monkeypatch: pytest.MonkeyPatch) -> None:
    install_hypercorn_patches(QUIC_SESSION_TICKETS)  # the gateway's screen in place
    screened: list[tuple[bytes, Any]] = []
    servers: list[ScreenedUDPServer] = []
    screen = ScreenedUDPServer.screen

    def recording(protocol: Any, data: bytes, address: Any, send: Any, now: float) -> bool:
        screened.append((data, address))
        return screen(protocol, data, address, send, now)

    init = ScreenedUDPServer.__init__

    def keep(self: ScreenedUDPServer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        servers.append(self)

    monkeypatch.setattr(ScreenedUDPServer, "screen", staticmethod(recording))
    monkeypatch.setattr(ScreenedUDPServer, "__init__", keep)
    graceful_s = 10.0
    async with gateway_listener(cert, graceful_timeout_s=graceful_s) as port:
        assert hypercorn.asyncio.run.UDPServer is ScreenedUDPServer
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.sendto(b"\x80\0\0\0\0" + b"x" * 20, ("127.0.0.1", port))  # Version Negotiation
            with anyio.fail_after(3):
                while not screened:
                    await anyio.sleep(0.02)
        (server,) = servers
        assert server.protocol_queue.maxsize == UDP_QUEUE_DATAGRAMS
        assert server.protocol_queue.empty()  # screened out, never queued
        stopping = time.monotonic()
    # Unpatched, UDPServer.run waits for a datagram after shutdown: the worker
    # sat out graceful_timeout; and its transport stayed open.
    assert time.monotonic() - stopping < graceful_s / 2
    assert server.transport is not None and server.transport.is_closing()
