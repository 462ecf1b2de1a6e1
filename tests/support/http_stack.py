"""Real listeners for the tests of ``hedgerow.http_stack``'s patches."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import trustme

from gateway.edge.devcert import DevCertificate
from gateway.edge.transport import build_config, serve

Message = dict[str, Any]


async def hello(scope: Message, receive: Any, send: Any) -> None:
    """Reads the whole body, answers ``hello``; lifespan accepted."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


@asynccontextmanager
async def gateway_listener(cert: DevCertificate, app: Any = hello, *, http3: bool = True,
                           graceful_timeout_s: float = 5.0,
                           **serve_options: Any) -> AsyncIterator[int]:
    """The gateway's transport (``gateway.edge.transport.serve``, every patch
    installed) on 127.0.0.1, a free port; yields the port. HTTP/1.1 is
    hypercorn's here, the path the patches change (``build_config``'s default;
    the gateway's own HTTP/1.1 server: ``tests/integration/test_h1_native.py``)."""
    config = build_config(host="127.0.0.1", port=0, certfile=cert.cert, keyfile=cert.key,
                          http3=http3, graceful_timeout_s=graceful_timeout_s)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        port = await tg.start(lambda task_status: serve(app, config, stop.wait,
                                                        task_status=task_status,
                                                        **serve_options))
        try:
            yield port
        finally:
            stop.set()


class MutualTls:
    """A CA, a server certificate for 127.0.0.1 and client certificates."""

    def __init__(self) -> None:
        self.ca = trustme.CA()
        self._server = self.ca.issue_cert("127.0.0.1", "localhost")

    def server(self, *, require_client_cert: bool = True) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._server.configure_cert(context)
        self.ca.configure_trust(context)
        context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
        return context

    def client(self, name: str | None = None) -> tuple[ssl.SSLContext, bytes | None]:
        """A client context (with a certificate for ``name``) and that certificate's DER."""
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        if name is None:
            return context, None
        issued = self.ca.issue_cert(name)
        issued.configure_cert(context)
        der = ssl.PEM_cert_to_DER_cert(issued.cert_chain_pems[0].bytes().decode())
        return context, der
