"""Session tickets survive one key rotation and not two, on a served port.

The transport is served with ``ticket_rotation_s`` = PERIOD. Time is cut
into periods on the monotonic clock (TCP keys) and the UTC clock (QUIC
tickets), and both clocks are the machine's, shared with this test: so the
test starts just after a period begins, takes tickets, and presents them
half a period into the next period (one rotation: they must resume) and
just into the period after (two rotations: a full handshake, still served).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from gateway.edge.transport import build_config, serve
from tests.integration.test_transport import _fetch_over_tls, client_context, streaming_app
from tests.support.h3client import h3_request

PERIOD = 2.0


@pytest.fixture(scope="module")
def dev_cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("rotation"))


@asynccontextmanager
async def rotating_gateway(cert: DevCertificate) -> AsyncIterator[int]:
    config = build_config(host="127.0.0.1", port=0, certfile=cert.cert, keyfile=cert.key,
                          ticket_rotation_s=PERIOD)
    stop = anyio.Event()
    async with anyio.create_task_group() as task_group:
        port = await task_group.start(serve, streaming_app, config, stop.wait)
        try:
            yield port
        finally:
            stop.set()


async def _at(clock: Callable[[], float], period: int, offset: float) -> None:
    """Sleep until ``offset`` seconds into period number ``period`` of ``clock``."""
    await anyio.sleep(max(0.0, period * PERIOD + offset - clock()))


async def _period_start(clock: Callable[[], float]) -> int:
    """Wait for the next period to begin; its number."""
    period = math.floor(clock() / PERIOD) + 1
    await _at(clock, period, 0.05)
    return period


@pytest.mark.anyio
async def test_tcp_ticket_resumes_after_one_rotation_not_two(dev_cert: DevCertificate) -> None:
    context = client_context(dev_cert)
    async with rotating_gateway(dev_cert) as port:
        period = await _period_start(time.monotonic)
        _, ticket, reused, version = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, context, None)
        _, other_ticket, _, _ = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, context, None)
        assert math.floor(time.monotonic() / PERIOD) == period, "tickets taken too late"
        assert not reused and version == "TLSv1.3"
        await _at(time.monotonic, period + 1, PERIOD / 2)  # rotated once
        _, _, within, _ = await anyio.to_thread.run_sync(_fetch_over_tls, port, context, ticket)
        await _at(time.monotonic, period + 2, 0.1)  # rotated twice
        response, _, after, _ = await anyio.to_thread.run_sync(
            _fetch_over_tls, port, context, other_ticket)
    assert within, "a ticket from before the rotation did not resume within the grace"
    assert not after, "a ticket two rotations old still resumed"
    assert response.startswith(b"HTTP/1.1 200")  # a full handshake, served


@pytest.mark.anyio
async def test_quic_ticket_resumes_after_one_rotation_not_two(dev_cert: DevCertificate) -> None:
    async with rotating_gateway(dev_cert) as port:
        period = await _period_start(time.time)
        first = await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert)
        second = await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert)
        assert math.floor(time.time() / PERIOD) == period, "tickets taken too late"
        assert first.session_ticket is not None and second.session_ticket is not None
        await _at(time.time, period + 1, PERIOD / 2)
        within = await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert,
                                  session_ticket=first.session_ticket, ticket_wait_s=0)
        await _at(time.time, period + 2, 0.1)
        after = await h3_request("127.0.0.1", port, cafile=dev_cert.ca_cert,
                                 session_ticket=second.session_ticket, ticket_wait_s=0)
    assert within.session_resumed
    assert not after.session_resumed and after.status == 200
