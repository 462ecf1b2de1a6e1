"""Talking to workers: one pooled HTTP client, errors mapped once.

``open_stream`` sends a request and returns the response with its body not yet
read, so tokens can be relayed as they arrive. Transport failures and 5xx
answers become ``UpstreamFailed`` (retryable on another worker, since nothing
reached the client yet); a worker's 4xx is the client's own mistake and is
passed through unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager

import httpx

from hedgerow.errors import UpstreamFailed
from policies.schema import Timeouts

CONNECT_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 1024


@contextmanager
def map_upstream_errors(worker_id: str) -> Iterator[None]:
    try:
        yield
    except httpx.TimeoutException as error:
        raise UpstreamFailed(f"worker {worker_id} timed out: {type(error).__name__}",
                             code="upstream_timeout") from error
    except httpx.TransportError as error:
        raise UpstreamFailed(f"worker {worker_id} unreachable: {type(error).__name__}",
                             code="upstream_unreachable") from error


class WorkerClient:
    def __init__(
        self, timeouts: Timeouts | None = None, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        """``transport``: an in-memory twin (``httpx.MockTransport``) for fast tests."""
        connect_s = timeouts.connect_ms / 1000 if timeouts else CONNECT_TIMEOUT_S
        # httpx's read timeout bounds each read: the idle gap between tokens.
        idle_s = timeouts.idle_ms / 1000 if timeouts else IDLE_TIMEOUT_S
        timeout = httpx.Timeout(connect=connect_s, read=idle_s, write=10.0, pool=connect_s)
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def open_stream(
        self, worker_id: str, url: str, body: bytes, request_id: str,
        extra_headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        headers = {"content-type": "application/json", "x-request-id": request_id,
                   **(extra_headers or {})}
        request = self._client.build_request("POST", url, content=body, headers=headers)
        with map_upstream_errors(worker_id):
            response = await self._client.send(request, stream=True)
        if response.status_code >= 500:
            await response.aclose()
            raise UpstreamFailed(
                f"worker {worker_id} answered {response.status_code}", code="upstream_error"
            )
        return response

    @staticmethod
    async def chunks(worker_id: str, response: httpx.Response) -> AsyncIterator[bytes]:
        with map_upstream_errors(worker_id):
            async for data in response.aiter_raw():
                yield data

    @staticmethod
    async def read_all(worker_id: str, response: httpx.Response) -> bytes:
        with map_upstream_errors(worker_id):
            return await response.aread()
