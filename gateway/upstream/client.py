"""Talking to workers: one pooled HTTP client, errors mapped once.

``open_stream`` sends a request and returns the response with its body not yet
read, so tokens can be relayed as they arrive. Any answer but a 200 is mapped
here, once (``reply_error``): a 400, 413 or 422 means the client's request was
bad (``UpstreamRejected``, a 400 with a generic message, not retried); a 404
that the upstream does not serve the model (or route) asked for
(``UpstreamModelNotFound``, a 404 ``model_not_found`` with a generic message,
not retried either); every other status (5xx and 429 included), and every
transport failure, is ``UpstreamFailed`` (retryable on another worker, since
nothing reached the client yet). Neither carries the
upstream's body or address to the client: those go to the log, in ``detail``.

The transport is ``gateway.upstream.worker_http.HttpPool`` (a lean HTTP/1.1 client: this
is the gateway's hot path) or its in-memory twin ``tests.support.worker_mock.MockTransport``.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

from gateway.upstream.http1 import HttpError, HttpTimeout, ProtocolError
from gateway.upstream.worker_http import HttpPool, PoolLimits
from hedgerow.errors import (HedgerowError, UpstreamFailed, UpstreamModelNotFound,
                             UpstreamRejected)
from hedgerow.trust.credentials import TlsContexts
from hedgerow.trust.identity import Identity, IdentityError
from policies.schema import Timeouts

CONNECT_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 60.0
WRITE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024  # per worker
MAX_IDLE_CONNECTIONS = 256  # per worker: enough for a busy worker's slots
MAX_BODY_BYTES = 1024 * 1024  # read_all's default cap
MAX_DETAIL_BYTES = 512  # of an error answer's body, kept for the log
# The statuses by which an upstream says the request itself is bad.
CLIENT_FAULT_STATUSES = frozenset({400, 413, 422})


class WorkerResponse(Protocol):
    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...  # lowercase names

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read_all(self, limit: int) -> bytes: ...

    async def aclose(self) -> None: ...


class WorkerTransport(Protocol):
    async def request(self, method: str, url: str, headers: dict[str, str],
                      body: bytes, *, peer: str = "") -> WorkerResponse: ...

    async def aclose(self) -> None: ...


@contextmanager
def map_upstream_errors(worker_id: str) -> Iterator[None]:
    try:
        yield
    except HttpTimeout as error:
        raise UpstreamFailed(f"worker {worker_id} timed out: {type(error).__name__}",
                             code="upstream_timeout") from error
    except ProtocolError as error:
        raise UpstreamFailed(f"worker {worker_id} sent a malformed response: {error}",
                             code="upstream_malformed") from error
    except HttpError as error:
        raise UpstreamFailed(f"worker {worker_id} unreachable: {type(error).__name__}: {error}",
                             code="upstream_unreachable") from error


@functools.lru_cache(maxsize=4096)  # per request on the hot path; worker ids are few
def worker_uri(worker_id: str) -> str:
    try:
        return Identity("worker", worker_id).uri
    except IdentityError:
        return "spiffe://hedgerow/worker/-invalid-"  # matches no certificate


def reply_error(worker_id: str, status: int, body: bytes) -> HedgerowError:
    """The error for a worker's non-200 answer (``body``: its first bytes, for the log)."""
    detail = f"worker {worker_id} answered {status}: {body[:MAX_DETAIL_BYTES]!r}"
    if status in CLIENT_FAULT_STATUSES:
        return UpstreamRejected(detail)
    if status == 404:
        return UpstreamModelNotFound(detail)
    code = "upstream_malformed" if 200 <= status < 300 else "upstream_error"
    return UpstreamFailed(detail, code=code)


class WorkerClient:
    def __init__(self, timeouts: Timeouts | None = None,
                 transport: WorkerTransport | None = None,
                 internal_tls: TlsContexts | None = None) -> None:
        """``transport``: an in-memory twin (``tests.support.worker_mock.MockTransport``) for tests."""
        connect_s = timeouts.connect_ms / 1000 if timeouts else CONNECT_TIMEOUT_S
        # Bounds each read: the idle gap between tokens (and the wait for the head).
        idle_s = timeouts.idle_ms / 1000 if timeouts else IDLE_TIMEOUT_S
        limits = PoolLimits(connect_s=connect_s, idle_s=idle_s, write_s=WRITE_TIMEOUT_S,
                            max_connections=MAX_CONNECTIONS, max_idle=MAX_IDLE_CONNECTIONS)
        self._transport: WorkerTransport = transport or HttpPool(limits,
                                                                 internal_tls=internal_tls)

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def open_stream(
        self, worker_id: str, url: str, body: bytes, request_id: str,
        extra_headers: Mapping[str, str] | None = None, *, internal: bool = False,
    ) -> WorkerResponse:
        """``internal``: a registered Hedgerow worker, reached over mutual TLS and
        accepted only if it proves the identity ``worker/<worker_id>``."""
        headers = {"content-type": "application/json", "x-request-id": request_id,
                   **(extra_headers or {})}
        with map_upstream_errors(worker_id):
            peer = worker_uri(worker_id) if internal and url.startswith("https:") else ""
            response = await self._transport.request("POST", url, headers, body, peer=peer)
        if response.status != 200:
            try:
                with map_upstream_errors(worker_id):
                    answer = await response.read_all(MAX_DETAIL_BYTES)
            except UpstreamFailed as failed:  # the status alone says enough
                answer = f"(its body unreadable: {failed.detail})".encode()
            finally:
                await response.aclose()
            raise reply_error(worker_id, response.status, answer)
        return response

    @staticmethod
    async def chunks(worker_id: str, response: WorkerResponse) -> AsyncGenerator[bytes, None]:
        with map_upstream_errors(worker_id):
            async for data in response.chunks():
                yield data

    @staticmethod
    async def read_all(worker_id: str, response: WorkerResponse,
                       limit: int = MAX_BODY_BYTES) -> bytes:
        with map_upstream_errors(worker_id):
            return await response.read_all(limit)
