"""Hedgerow's own HTTP/1.1 server for the gateway's public port (the default).

Hypercorn serves HTTP/1.1 through h11 (pure-Python parsing and framing), an
ASGI message per chunk through a chain of coroutines, and a stream writer
that awaits ``drain`` after each write; measured on this stack
(``docs/benchmarks.md``, "overhead"), that alone costs more CPU per request
and per streamed token than nginx spends proxying both hops. This package is
the client-facing HTTP/1.1 path written for the cost of the hot path: an
``asyncio.Protocol`` fed by llhttp (``httptools``, the C parser nginx-class
Python servers use), the response head written with the first body bytes,
each body message one ``transport.write`` (one TLS record), flow control
through ``pause_writing`` / ``resume_writing`` instead of a drain per write.

Where it plugs in: the capped accept loop (``hedgerow.connection_cap``)
decides per connection after the TLS handshake: a client that negotiated
``h2`` by ALPN goes to hypercorn as before; HTTP/1.1 goes to
``H1Connection`` when the listener's ``ACTIVE_H1`` holds ``H1Settings``
(``hedgerow gateway``, whose ``--http1`` is ``native`` unless set to
``hypercorn``; ``build_config(native_http1=...)`` for other listeners).
HTTP/2 and HTTP/3 are untouched.

The bounds match what the hypercorn path enforces (``gateway.edge.transport``):
the head must be complete within the keep-alive timeout of the connection's
start or its last response, and within ``max_header_bytes``; requests per
connection are capped (the last answered with ``connection: close``); a
request carrying both ``content-length`` and ``transfer-encoding`` is
refused (llhttp's default). Module: ``hedgerow.h1.connection``.
"""

from __future__ import annotations

from hedgerow.h1.connection import ACTIVE_H1, H1Connection, H1Settings

__all__ = ["ACTIVE_H1", "H1Connection", "H1Settings"]
