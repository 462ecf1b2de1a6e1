"""``http_stack.tls_peer``: each request sees its own connection's verified
client certificate, which hypercorn does not hand an ASGI app."""

from __future__ import annotations

import hashlib
from typing import Any

import anyio
import httpx
import pytest

from hedgerow.http_stack.tls_peer import CONNECTION_TLS
from hedgerow.serving import serve_internal
from tests.support.http_stack import MutualTls

pytestmark = pytest.mark.anyio


async def which_peer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    tls = CONNECTION_TLS.get()
    der = tls.getpeercert(binary_form=True) if tls is not None else None
    body = hashlib.sha256(der).hexdigest().encode() if der else b"none"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def test_each_connection_sees_its_own_client_certificate() -> None:
    pki = MutualTls()
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve_internal(
            which_peer, "127.0.0.1", 0, shutdown, tls=pki.server(), task_status=task_status))
        url = f"https://127.0.0.1:{port}/"
        clients = {name: pki.client(name) for name in ("alice@example.org", "bob@example.org")}
        async with (httpx.AsyncClient(verify=clients["alice@example.org"][0]) as alice,
                    httpx.AsyncClient(verify=clients["bob@example.org"][0]) as bob):
            for _ in range(2):  # interleaved requests on two kept-alive connections
                for client, (_, der) in ((alice, clients["alice@example.org"]),
                                         (bob, clients["bob@example.org"])):
                    assert der is not None
                    answer = await client.get(url)
                    assert answer.text == hashlib.sha256(der).hexdigest()
        shutdown.set()
