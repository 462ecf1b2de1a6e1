"""``http_stack.h2_protocol`` on a real HTTP/2 connection: DATA after a stream's
response ended no longer kills the connection, and a read's events are
flushed once, not once per event."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import anyio
import pytest
from h2.connection import H2Connection

from gateway.edge.devcert import DevCertificate, ensure_dev_certificate
from tests.support.h2raw import RawH2
from tests.support.http_stack import gateway_listener

pytestmark = pytest.mark.anyio
DATA_FRAMES = 24


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> DevCertificate:
    return ensure_dev_certificate(tmp_path_factory.mktemp("state"))


async def refuse_large(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/large`` answers 413 before reading its body; the rest read it all."""
    if scope["type"] != "http":
        return
    if scope["path"] != "/large":
        while (await receive()).get("more_body"):
            pass
    status = 413 if scope["path"] == "/large" else 200
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"done"})


def _late_data_then_another_request(port: int, cafile: str) -> tuple[int, bool]:
    conn = RawH2(port, cafile)
    try:
        large = conn.new_stream()
        conn.send(conn.request_headers(large, "/large", "POST", end_stream=False))
        while large not in conn.read(0.5).ended_streams:
            pass
        # The response has ended: hypercorn has forgotten the stream.
        conn.send(*[conn.data(large, b"x" * 100) for _ in range(5)],
                  conn.data(large, b"x", end_stream=True))
        small = conn.new_stream()
        conn.send(conn.request_headers(small, "/small"))
        for _ in range(40):
            if small in conn.read(0.1).ended_streams:
                break
        return small, small in conn.said.ended_streams and not conn.said.cut
    finally:
        conn.close()


async def test_late_data_leaves_the_connection_and_its_next_stream_alive(
        cert: DevCertificate) -> None:
    async with gateway_listener(cert, refuse_large, http3=False) as port:
        _, served = await anyio.to_thread.run_sync(
            _late_data_then_another_request, port, str(cert.ca_cert))
        assert served


def _one_read_of_many_frames(port: int, cafile: str) -> bytes:
    conn = RawH2(port, cafile)
    try:
        conn.read(0.3)  # the server's SETTINGS, answered
        stream = conn.new_stream()
        frames = [conn.request_headers(stream, "/upload", "POST", end_stream=False)]
        frames += [conn.data(stream, b"y" * 50) for _ in range(DATA_FRAMES)]
        frames.append(conn.data(stream, b"", end_stream=True))
        conn.send(*frames)  # one TLS record: one read on the server
        for _ in range(50):
            if stream in conn.read(0.1).ended_streams:
                break
        return bytes(conn.said.data.get(stream, b""))
    finally:
        conn.close()


async def test_a_read_of_many_events_is_flushed_once(
        cert: DevCertificate, monkeypatch: pytest.MonkeyPatch) -> None:
    flushes: Counter[str] = Counter()
    data_to_send = H2Connection.data_to_send

    def counted(self: H2Connection, *args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        flushes[task.get_name() if task else "?"] += 1
        return data_to_send(self, *args, **kwargs)

    monkeypatch.setattr(H2Connection, "data_to_send", counted)
    async with gateway_listener(cert, refuse_large, http3=False) as port:
        body = await anyio.to_thread.run_sync(_one_read_of_many_frames, port, str(cert.ca_cert))
    assert body == b"done"
    # The reading task handled HEADERS, 24 DATA frames and END_STREAM: one
    # flush for the connection preface's read, one for this read (hypercorn
    # with the guard feeding it event by event: one per event, 26+).
    reader = max(flushes.values())
    assert reader <= 6, flushes
