"""HTTP clients for the load generator: where to send (``Target``) and over what.

``HttpClients`` leases a client per request in flight — httpx for HTTP/1.1
and HTTP/2, ``bench.h3`` for HTTP/3 — and ``open_stream`` starts one
streaming POST on it, returning a ``StreamingResponse`` either way.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import anyio
import httpx
import orjson

from bench.h3 import H3Client
from bench.records import HEADERS_OF_INTEREST


@dataclass(frozen=True)
class Target:
    """Where to send: base URL, HTTP version, trust, and per-request limits."""

    base_url: str
    http_version: Literal["1.1", "2", "3"] = "1.1"
    ca_file: Path | None = None  # e.g. the gateway's dev CA; None: system trust
    # A client certificate to present (a directory with cert.pem and key.pem), e.g.
    # the cluster's admin credential for a worker's mutual-TLS URL; a worker is
    # known by its identity, not a hostname (check_hostname=False then).
    client_identity: Path | None = None
    check_hostname: bool = True
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with every request
    request_timeout_s: float = 60.0  # whole request, from the actual send
    headers_of_interest: tuple[str, ...] = HEADERS_OF_INTEREST


class HttpClients:
    """Clients for ``target`` (httpx, or ``bench.h3`` for HTTP/3), leased one per request in flight.

    HTTP/1.1: each lease gets a client that holds a single keep-alive
    connection, reused by later leases. httpcore's pool scans all of its
    connections for every queued request, which with a hundred connections in
    one pool costs more CPU than the requests themselves and makes the load
    generator the bottleneck; a hundred one-connection pools cost nothing.
    HTTP/2: one shared client multiplexes every request (TLS by ALPN, h2c by
    prior knowledge on ``http://`` URLs). HTTP/3: one QUIC connection
    (``bench.h3``) multiplexes every request.
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        # Built once: loading a CA bundle costs tens of ms, too much for every new client.
        self._tls = (ssl.create_default_context(cafile=str(target.ca_file)) if target.ca_file
                     else httpx.create_ssl_context())
        self._tls.check_hostname = target.check_hostname
        if target.client_identity is not None:
            self._tls.load_cert_chain(target.client_identity / "cert.pem",
                                      target.client_identity / "key.pem")
        self._shared: httpx.AsyncClient | None = None  # HTTP/2
        self._quic: H3Client | None = None  # HTTP/3
        self._quic_lock = anyio.Lock()
        self._idle: list[httpx.AsyncClient] = []  # HTTP/1.1, most recently used last
        self._all: list[httpx.AsyncClient] = []

    async def __aenter__(self) -> HttpClients:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[httpx.AsyncClient | H3Client]:
        if self.target.http_version == "3":
            yield await self._quic_client()
            return
        if self.target.http_version == "2":
            self._shared = self._shared or self._new_client(connections=None)
            yield self._shared
            return
        client = self._idle.pop() if self._idle else self._new_client(connections=1)
        try:
            yield client
        finally:
            self._idle.append(client)

    async def aclose(self) -> None:
        clients, self._all, self._idle, self._shared = self._all, [], [], None
        for client in clients:
            await client.aclose()
        quic, self._quic = self._quic, None
        if quic is not None:
            await quic.aclose()

    async def _quic_client(self) -> H3Client:
        async with self._quic_lock:  # the first requests of a run share one handshake
            if self._quic is None:
                quic = H3Client(self.target.base_url, self.target.ca_file, self.target.headers)
                await quic.connect()
                self._quic = quic
            return self._quic

    def _new_client(self, *, connections: int | None) -> httpx.AsyncClient:
        target = self.target
        http2 = target.http_version == "2"
        client = httpx.AsyncClient(
            base_url=target.base_url, http1=not http2, http2=http2, verify=self._tls,
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            timeout=httpx.Timeout(target.request_timeout_s), headers=dict(target.headers),
        )
        self._all.append(client)
        return client


class StreamingResponse(Protocol):
    """What ``_exchange`` reads of a response: ``httpx.Response`` or ``bench.h3.H3Response``."""

    @property
    def status_code(self) -> int: ...
    @property
    def http_version(self) -> str: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    def aiter_bytes(self) -> AsyncIterator[bytes]: ...
    async def aread(self) -> bytes: ...


def open_stream(client: httpx.AsyncClient | H3Client, path: str, body: Any, extra_headers: Mapping[str, str]
                 ) -> AbstractAsyncContextManager[StreamingResponse]:
    """Start a streaming JSON POST of ``body`` to ``path``; use as ``async with``."""
    headers = {"content-type": "application/json", **extra_headers}
    return client.stream("POST", path, content=orjson.dumps(body), headers=headers)
