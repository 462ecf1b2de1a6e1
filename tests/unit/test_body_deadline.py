"""``Request.body``'s deadline, in-process: a body that stops arriving is
refused with 408 once the deadline passes, whatever its pace before."""

from __future__ import annotations

import anyio
import pytest

from hedgerow.asgi import Message, Receive, Request, Scope
from hedgerow.errors import RequestTimeout
from policies.schema import Policy

pytestmark = pytest.mark.anyio


def _request(chunks: list[bytes], http_version: str = "1.1", every_s: float = 0.0) -> Request:
    """A request whose body comes as ``chunks`` (``every_s`` apart), then never ends."""
    pending = list(chunks)

    async def receive() -> Message:
        await anyio.sleep(every_s)
        if pending:
            return {"type": "http.request", "body": pending.pop(0), "more_body": True}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        raise AssertionError("body() sends nothing")

    scope: Scope = {"type": "http", "method": "POST", "path": "/", "headers": [],
                    "http_version": http_version}
    return Request(scope, receive, send)


async def test_a_stalled_body_is_refused_at_its_deadline_with_408() -> None:
    request = _request([b'{"a"', b": 1"])
    started = anyio.current_time()
    with pytest.raises(RequestTimeout) as caught:
        await request.body(1024, deadline_s=0.2)
    assert 0.2 <= anyio.current_time() - started < 0.5
    assert caught.value.status == 408
    assert caught.value.envelope()["error"]["code"] == "request_timeout"
    # Nothing more is read of it: the server closes an HTTP/1.1 connection.
    assert request.body_done
    assert (b"connection", b"close") in caught.value.headers()


async def test_a_trickle_is_refused_even_though_every_byte_is_prompt() -> None:
    request = _request([b"x"] * 100, every_s=0.05)
    with pytest.raises(RequestTimeout):
        await request.body(1024, deadline_s=0.3)


async def test_over_http2_only_the_stream_ends_no_connection_header() -> None:
    with pytest.raises(RequestTimeout) as caught:
        await _request([b"x"], http_version="2").body(1024, deadline_s=0.1)
    assert all(name != b"connection" for name, _ in caught.value.headers())


async def test_a_body_in_time_is_read_and_no_deadline_means_none() -> None:
    in_time = _request([b'{"a"', b": 1"], every_s=0.05)
    in_time.receive = _ending(in_time.receive, after=2)
    assert await in_time.body(1024, deadline_s=1.0) == b'{"a": 1'
    unbounded = _request([b"{", b"}"], every_s=0.05)
    unbounded.receive = _ending(unbounded.receive, after=2)
    assert await unbounded.body(1024) == b"{}"


def _ending(receive: Receive, after: int) -> Receive:
    """``receive`` whose body ends after ``after`` chunks."""
    count = 0

    async def ending() -> Message:
        nonlocal count
        message = await receive()
        count += 1
        return {**message, "more_body": count < after}

    return ending


def test_the_policy_knob_defaults_to_ten_seconds_and_is_bounded() -> None:
    assert Policy().timeouts.body_ms == 10_000
    assert Policy.model_validate({"timeouts": {"body_ms": 1500}}).timeouts.body_ms == 1500
    with pytest.raises(ValueError):
        Policy.model_validate({"timeouts": {"body_ms": 0}})
