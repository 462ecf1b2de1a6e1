"""The in-memory twin of ``gateway.upstream.worker_http.HttpPool``, for fast tests.

Like ``httpx.MockTransport``: upstream behaviour is a small function from a
``WorkerRequest`` to a ``MockReply`` (status, headers, body as bytes or as a
sync or async iterable of chunks). The handler may be sync or async, and may
raise the client's own errors (``gateway.upstream.http1.ConnectFailed``, ...) to play a
broken network; so may the body iterator, mid-stream.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MockBody = bytes | Iterable[bytes] | AsyncIterable[bytes]


@dataclass(frozen=True)
class WorkerRequest:
    method: str
    url: str
    headers: Mapping[str, str]
    body: bytes

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


@dataclass
class MockReply:
    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: MockBody = b""


Handler = Callable[[WorkerRequest], MockReply | Awaitable[MockReply]]


class MockResponse:
    """Satisfies ``gateway.upstream.client.WorkerResponse``; closing it closes the body iterator."""

    def __init__(self, reply: MockReply) -> None:
        self.status = reply.status
        self.headers = {k.lower(): v for k, v in reply.headers.items()}
        self._body = reply.body

    async def chunks(self) -> AsyncIterator[bytes]:
        body = self._body
        if isinstance(body, bytes):
            if body:
                yield body
        elif isinstance(body, AsyncIterable):
            async for data in body:
                if data:
                    yield data
        else:
            for data in body:
                if data:
                    yield data

    async def read_all(self, limit: int) -> bytes:
        pieces = [data async for data in self.chunks()]
        await self.aclose()
        return b"".join(pieces)[:limit]

    async def aclose(self) -> None:
        close = getattr(self._body, "aclose", None)
        if close is not None:
            await close()


class MockTransport:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def request(self, method: str, url: str, headers: dict[str, str],
                      body: bytes, *, peer: str = "") -> MockResponse:
        reply = self.handler(WorkerRequest(method, url, headers, body))
        if inspect.isawaitable(reply):
            reply = await reply
        return MockResponse(reply)

    async def aclose(self) -> None:
        pass
