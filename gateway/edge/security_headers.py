"""Browser-facing security headers on every response of the public port.

An ASGI middleware, outermost on the public listener, so CORS refusals,
errors and the chat page get them alike:

- ``x-content-type-options: nosniff``: a JSON error or an SSE stream is never
  sniffed into something a browser would run.
- ``referrer-policy: no-referrer``: the page's URL leaks nowhere.
- ``content-security-policy``: the chat page (``gateway.edge.page``) sets its own,
  which admits only its one inline script and style by their SHA-256 and
  ``connect-src 'self'``; every other response gets ``default-src 'none'``.
  Both say ``frame-ancestors 'none'`` (no clickjacking through a frame), as
  does ``x-frame-options: DENY`` for browsers that predate CSP 2.
- ``strict-transport-security`` on HTTPS responses (every response of the
  gateway's TLS and QUIC listeners) for a host name. Not for ``localhost``:
  HSTS holds for every port of a host, and would force HTTPS onto every other
  development server there. (Browsers ignore it for IP literals, RFC 6797 §8.1.)

The decisions are plain functions of the scope; ``SecurityHeaders`` only adds
the headers to ``http.response.start``.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Awaitable, Callable

from hedgerow.asgi import Headers, Message, Receive, Scope, Send

App = Callable[[Scope, Receive, Send], Awaitable[None]]

HSTS_MAX_AGE_S = 63_072_000  # two years, what hstspreload.org asks for
API_CSP = b"default-src 'none'; frame-ancestors 'none'"
ALWAYS: Headers = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


def request_host(scope: Scope) -> str | None:
    """The host the client asked for (``Host``, or ``:authority`` as Hypercorn
    passes it), without its port; None when absent."""
    for name, value in scope.get("headers", ()):
        if name.lower() in (b"host", b":authority"):
            host = bytes(value).decode("latin-1").strip().lower()
            if host.startswith("["):
                return host[1:host.find("]")] if "]" in host else None
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return None


def wants_hsts(scope: Scope) -> bool:
    """HSTS on HTTPS for a real host name: not localhost, not an IP literal."""
    if scope.get("scheme") != "https":
        return False
    host = request_host(scope)
    if not host or host == "localhost" or host.endswith(".localhost"):
        return False
    return not _is_ip_literal(host)


@functools.lru_cache(maxsize=64)  # clients send a handful of hosts; any other is parsed again
def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def security_headers(scope: Scope, present: Headers) -> Headers:
    """The headers to add to a response that already carries ``present``."""
    names = {name.lower() for name, _ in present}
    added = [(name, value) for name, value in ALWAYS if name not in names]
    if b"content-security-policy" not in names:
        added.append((b"content-security-policy", API_CSP))
    if wants_hsts(scope) and b"strict-transport-security" not in names:
        added.append((b"strict-transport-security", b"max-age=%d" % HSTS_MAX_AGE_S))
    return added


class SecurityHeaders:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = list(message.get("headers", []))
                message = {**message, "headers": present + security_headers(scope, present)}
            await send(message)

        await self.app(scope, receive, with_headers)
