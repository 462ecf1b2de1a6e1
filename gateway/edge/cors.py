"""CORS for browser origins: an ASGI middleware around the gateway app.

The policy's ``cors:`` section says which other origins may call the API from
their pages. The decisions are sans-IO functions of (policy, request headers);
``CorsMiddleware`` only applies them:

- A request without ``Origin``, or from the gateway's own origin (the chat
  page at ``/``), passes through untouched.
- A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) for a path
  the app serves is answered here and never reaches the app: 204 with the
  allowed methods and headers and ``Access-Control-Max-Age`` when origin,
  method and every requested header are allowed, else 403. One for a path
  the app does not serve (``/metrics``, say) goes to the app, which answers
  404 like any unknown path.
- Any other cross-origin request from an origin not allowed gets 403 before
  the app runs (no generation is spent on a page the browser would not let
  read the answer); from an allowed one it runs, and the response carries
  ``Access-Control-Allow-Origin`` and ``-Expose-Headers``.

Credentials rules: with ``allow_credentials`` the response names the exact
origin (never ``*``; the schema refuses ``*`` with credentials) and adds
``Access-Control-Allow-Credentials: true``; a response that names an origin
also says ``Vary: Origin`` so shared caches keep origins apart.
``apply_policy`` swaps the section in for requests that arrive afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hedgerow.asgi import Headers, Message, Receive, Scope, Send, discard_request_body, send_error
from hedgerow.errors import InvalidRequest
from policies.schema import Cors, Policy

App = Callable[[Scope, Receive, Send], Awaitable[None]]

PREFLIGHT_VARY = b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"


class OriginNotAllowed(InvalidRequest):
    """403: a cross-origin browser request the policy's ``cors:`` does not admit."""

    status = 403
    default_code = "origin_not_allowed"


@dataclass(frozen=True)
class Preflight:
    """The answer to one preflight: 204 with ``headers``, or ``refusal``."""

    headers: Headers
    refusal: OriginNotAllowed | None = None


def is_same_origin(origin: str, scheme: str, host: str | None) -> bool:
    """Whether ``origin`` is the origin the request was sent to: scheme plus
    ``Host`` (HTTP/1.1) or ``:authority`` (HTTP/2 and 3, as Hypercorn passes it)."""
    return host is not None and origin.lower() == f"{scheme}://{host}".lower()


def origin_allowed(cors: Cors, origin: str) -> bool:
    return "*" in cors.allow_origins or origin in cors.allow_origins


def _allow_origin(cors: Cors, origin: str) -> Headers:
    if "*" in cors.allow_origins and not cors.allow_credentials:
        return [(b"access-control-allow-origin", b"*")]
    headers = [(b"access-control-allow-origin", origin.encode("latin-1"))]
    if cors.allow_credentials:
        headers.append((b"access-control-allow-credentials", b"true"))
    return headers


def preflight(cors: Cors, origin: str, method: str, requested_headers: str | None) -> Preflight:
    """Decide a preflight for ``origin`` asking to send ``method`` with headers."""
    vary: Headers = [(b"vary", PREFLIGHT_VARY)]
    if not origin_allowed(cors, origin):
        return Preflight(vary, OriginNotAllowed(f"origin {origin!r} is not allowed (policy cors)"))
    if method not in cors.allow_methods:
        return Preflight(vary, OriginNotAllowed(
            f"method {method!r} is not allowed cross-origin (allowed: "
            f"{', '.join(cors.allow_methods)})"))
    wanted = [name.strip().lower() for name in (requested_headers or "").split(",")]
    refused = [name for name in wanted if name and name not in cors.allow_headers]
    if refused:
        return Preflight(vary, OriginNotAllowed(
            f"header(s) {', '.join(refused)} not allowed cross-origin (allowed: "
            f"{', '.join(cors.allow_headers)})"))
    headers = _allow_origin(cors, origin) + [
        (b"access-control-allow-methods", ", ".join(cors.allow_methods).encode()),
        (b"access-control-max-age", str(cors.max_age_s).encode()),
        *vary,
    ]
    if cors.allow_headers:
        headers.append((b"access-control-allow-headers", ", ".join(cors.allow_headers).encode()))
    return Preflight(headers)


def response_headers(cors: Cors, origin: str) -> Headers:
    """Headers an allowed cross-origin response carries."""
    headers = _allow_origin(cors, origin)
    if cors.expose_headers:
        headers.append((b"access-control-expose-headers", ", ".join(cors.expose_headers).encode()))
    if headers[0][1] != b"*":
        headers.append((b"vary", b"Origin"))
    return headers


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class CorsMiddleware:
    """Wraps the gateway's ASGI app; follows the policy through ``apply_policy``."""

    def __init__(self, app: App, cors: Cors,
                 serves: Callable[[str], bool] = lambda path: True) -> None:
        self.app = app
        self.cors = cors
        self.serves = serves  # whether the app has a route for a path

    def apply_policy(self, policy: Policy) -> None:
        self.cors = policy.cors  # one swap: a request sees the old or the new section

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = _header(scope, b"origin") if scope["type"] == "http" else None
        if origin is None or is_same_origin(
                origin, str(scope.get("scheme", "https")),
                _header(scope, b"host") or _header(scope, b":authority")):
            await self.app(scope, receive, send)
            return
        cors = self.cors
        requested_method = _header(scope, b"access-control-request-method")
        if (scope["method"] == "OPTIONS" and requested_method is not None
                and self.serves(str(scope["path"]))):
            answer = preflight(cors, origin, requested_method,
                               _header(scope, b"access-control-request-headers"))
            if answer.refusal is not None:
                await send_error(send, answer.refusal, answer.headers)
                return
            await send({"type": "http.response.start", "status": 204, "headers": answer.headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if not origin_allowed(cors, origin):
            await discard_request_body(scope, receive)
            await send_error(send, OriginNotAllowed(
                f"origin {origin!r} is not allowed (policy cors)"), [(b"vary", b"Origin")])
            return
        extra = response_headers(cors, origin)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
