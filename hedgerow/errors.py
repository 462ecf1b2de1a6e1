"""The one error hierarchy of Hedgerow, and its mapping to HTTP.

Every error that can reach a client is a ``HedgerowError`` subclass carrying
exactly one HTTP status and one OpenAI error ``type``; ``envelope()`` renders
the OpenAI error envelope ``{"error": {"message", "type", "code"}}``.

    HedgerowError                       500 server_error
    ├── InvalidRequest                  400 invalid_request_error
    │   ├── RouteNotFound               404
    │   ├── ModelNotFound               404  code=model_not_found
    │   ├── UnknownWorker               404  code=unknown_worker
    │   ├── UnknownPolicyVersion        404  code=unknown_policy_version
    │   ├── StreamNotFound              404  code=stream_not_found
    │   ├── KeyNotFound                 404  code=key_not_found
    │   ├── StreamGone                  410  code=stream_gone
    │   ├── PolicyError                 400  code=invalid_policy (policies.schema;
    │   │                                    carries file:line:column issues)
    │   ├── UpstreamRejected            400  code=upstream_rejected_request (a
    │   │   │                                worker's 400/413/422; generic message)
    │   │   └── UpstreamModelNotFound   404  code=model_not_found (a worker's 404;
    │   │                                    generic message)
    │   ├── MethodNotAllowed            405
    │   ├── RequestTimeout              408  code=request_timeout (HTTP/1.1:
    │   │                                    Connection: close)
    │   ├── PayloadTooLarge             413
    │   └── UnsupportedMediaType        415
    ├── AuthenticationFailed            401 authentication_error
    ├── PermissionDenied                403 permission_error (an internal caller's
    │                                        identity may not do this)
    ├── Conflict                        409 conflict_error
    ├── RateLimited                     429 rate_limit_exceeded (Retry-After)
    │   └── BudgetExceeded              429  code=budget_exceeded (Retry-After: the reset)
    ├── NoHealthyWorker                 503 service_unavailable (Retry-After)
    ├── GatewayDraining                 503 service_unavailable (Retry-After)
    ├── PolicyUnavailable               503 service_unavailable (Retry-After)
    ├── EmbeddingsUnavailable           503 service_unavailable (Retry-After)
    ├── UpstreamFailed                  502 upstream_error (message fixed per code;
    │                                        the worker's detail is for the log only)
    ├── RuntimeFault                    500 server_error
    │   ├── ActorDead
    │   ├── AskTimeout
    │   ├── ModelUnavailable            code=model_unavailable
    │   └── MailboxFull                 code=mailbox_full
    └── AnthropicShaped                 any of the above, rendered for ``POST /v1/messages``

Anthropic's Messages API answers errors as ``{"type": "error", "error":
{"type", "message"}, "request_id"}``; ``anthropic_error_type`` maps each of
the above onto its types, and ``AnthropicShaped`` renders one so. Its statuses
are the same, except that "no capacity" (503) is Anthropic's ``529
overloaded_error``, which its SDKs retry as they do a 503.
"""

from __future__ import annotations

from typing import Any


class HedgerowError(Exception):
    status: int = 500
    error_type: str = "server_error"
    default_code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.retry_after = retry_after

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(max(1, round(self.retry_after))).encode())]


class InvalidRequest(HedgerowError):
    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class RouteNotFound(InvalidRequest):
    status = 404
    default_code = "not_found"


class ModelNotFound(InvalidRequest):
    status = 404
    default_code = "model_not_found"


class UnknownWorker(InvalidRequest):
    status = 404
    default_code = "unknown_worker"


class UnknownPolicyVersion(InvalidRequest):
    status = 404
    default_code = "unknown_policy_version"


class StreamNotFound(InvalidRequest):
    """No resumable stream by that id for this tenant (never says which)."""

    status = 404
    default_code = "stream_not_found"


class KeyNotFound(InvalidRequest):
    """``hedgerow key revoke`` of an id that is not a key (revoked already, or a typo)."""

    status = 404
    default_code = "key_not_found"


class StreamGone(InvalidRequest):
    """The stream existed, but its retention ran out or the events asked for were dropped."""

    status = 410
    default_code = "stream_gone"


class UpstreamRejected(InvalidRequest):
    """A worker or external upstream refused the request as invalid (400, 413, 422):
    the client's mistake, so not retried elsewhere. What the upstream said stays in
    ``detail`` (for the log): its body may name hosts, keys or its own internals."""

    default_code = "upstream_rejected_request"
    public_message = ("the model server refused the request as invalid; check its "
                      "parameters (max_tokens against the model's context, for example)")
    # True when the refusal says more about the worker than about the request:
    # not retried, but its breaker is told (a worker that keeps refusing gets none).
    worker_fault = False

    def __init__(self, detail: str) -> None:
        super().__init__(self.public_message)
        self.detail = detail


class UpstreamModelNotFound(UpstreamRejected):
    """A worker or external upstream answered 404: it does not serve the model (or
    the route) it was asked for. Another worker would most likely answer the same,
    so it is not retried; the client gets a 404 ``model_not_found`` with a fixed
    message, the upstream's words stay in ``detail``. The gateway routes a model
    only to workers registered for it, so the worker is the one at fault: its
    breaker is told, and one that keeps answering 404 stops getting requests."""

    status = 404
    default_code = "model_not_found"
    public_message = "the model server does not serve the requested model"
    worker_fault = True


class MethodNotAllowed(InvalidRequest):
    status = 405
    default_code = "method_not_allowed"


class RequestTimeout(InvalidRequest):
    """The request body did not arrive in time (``timeouts.body_ms``). Its rest
    is never read, so over HTTP/1.1 the connection cannot carry another
    request: ``close_connection`` says so in the answer, and the server closes it."""

    status = 408
    default_code = "request_timeout"

    def __init__(self, message: str, *, close_connection: bool = False) -> None:
        super().__init__(message)
        self.close_connection = close_connection

    def headers(self) -> list[tuple[bytes, bytes]]:
        # HTTP/2 and HTTP/3 forbid connection headers: only the stream ends there.
        closing = [(b"connection", b"close")] if self.close_connection else []
        return super().headers() + closing


class PayloadTooLarge(InvalidRequest):
    status = 413
    default_code = "payload_too_large"


class UnsupportedMediaType(InvalidRequest):
    status = 415
    default_code = "unsupported_media_type"


class AuthenticationFailed(HedgerowError):
    status = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(HedgerowError):
    """The caller is who it says (its certificate verified) but may not do this."""

    status = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class Conflict(HedgerowError):
    status = 409
    error_type = "conflict_error"
    default_code = "conflict"


class RateLimited(HedgerowError):
    status = 429
    error_type = "rate_limit_exceeded"
    default_code = "rate_limit_exceeded"


class BudgetExceeded(RateLimited):
    """A tenant's or key's token or cost budget for the day or month is spent
    (``policies.budget``); Retry-After points at the budget's reset."""

    default_code = "budget_exceeded"


class NoHealthyWorker(HedgerowError):
    status = 503
    error_type = "service_unavailable"
    default_code = "no_healthy_worker"


class GatewayDraining(HedgerowError):
    """The gateway is shutting down: retry on another one (readiness is 503 already)."""

    status = 503
    error_type = "service_unavailable"
    default_code = "gateway_draining"


class BodyBudgetExhausted(HedgerowError):
    """Too many request bodies are being read at once (``hedgerow.body_budget``):
    refused at once rather than queued; retry shortly."""

    status = 503
    error_type = "service_unavailable"
    default_code = "body_budget_exhausted"


class PolicyUnavailable(HedgerowError):
    """No policy in force yet: the gateway follows the control plane's and has
    not received one (an operator pins one with ``--policy``)."""

    status = 503
    error_type = "service_unavailable"
    default_code = "policy_unavailable"


class SharedStateUnavailable(HedgerowError):
    """The control plane's shared store (Redis) cannot be reached right now."""

    status = 503
    error_type = "service_unavailable"
    default_code = "shared_state_unavailable"


class UpstreamFailed(HedgerowError):
    """A worker or external upstream failed (unreachable, slow, an error status,
    a malformed or truncated stream). What a client reads is fixed by ``code``
    (``PUBLIC_MESSAGES``): never a worker's id, address, env var or words.
    ``detail`` says what happened, for the operators' log."""

    status = 502
    error_type = "upstream_error"
    default_code = "upstream_failed"

    def __init__(self, detail: str, *, code: str | None = None,
                 retry_after: float | None = None) -> None:
        code = code or self.default_code
        public = PUBLIC_MESSAGES.get(code, PUBLIC_MESSAGES[self.default_code])
        super().__init__(public, code=code, retry_after=retry_after)
        self.detail = detail


PUBLIC_MESSAGES = {
    "upstream_failed": "the model server failed",
    "upstream_error": "the model server answered with an error",
    "upstream_unreachable": "the model server could not be reached",
    "upstream_timeout": "the model server timed out",
    "ttft_timeout": "the model server sent no token in time",
    "upstream_malformed": "the model server sent a malformed response",
    "upstream_truncated": "the model server ended the answer before it was complete",
    "upstream_misconfigured": "the gateway is not configured to reach the model server",
    "upstream_key_missing": "the gateway is not configured to reach the model server",
    "stream_cancelled": "the generation stopped before it was complete",
}


class RuntimeFault(HedgerowError):
    """An internal failure of Hedgerow's own machinery."""


class ActorDead(RuntimeFault):
    default_code = "actor_dead"


class AskTimeout(RuntimeFault):
    default_code = "ask_timeout"


class ModelUnavailable(RuntimeFault):
    """The model file a worker was told to serve cannot be found or loaded."""

    default_code = "model_unavailable"


class MailboxFull(RuntimeFault):
    default_code = "mailbox_full"


# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
_ANTHROPIC_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_OVERLOADED_STATUS = 529
# Hedgerow's OpenAI types whose status is not enough (a stream's error event has none).
_ANTHROPIC_BY_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "rate_limit_exceeded": "rate_limit_error",
    "service_unavailable": "overloaded_error",
}


def anthropic_error_type(error_type: str, status: int | None = None) -> str:
    """Anthropic's ``error.type`` for a Hedgerow error of ``error_type`` (and ``status``)."""
    by_status = _ANTHROPIC_BY_STATUS.get(status) if status is not None else None
    if by_status is not None:
        return by_status
    if status is not None and 400 <= status < 500:
        return "invalid_request_error"  # 405, 408, 409, 410, 415: the request's fault
    return _ANTHROPIC_BY_TYPE.get(error_type, "api_error")


def anthropic_error_body(message: str, error_type: str,
                         request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


class AnthropicShaped(HedgerowError):
    """``error`` as Anthropic's Messages API renders it: same meaning, headers
    (``Retry-After``) and status, but 503 is 529 ``overloaded_error``."""

    def __init__(self, error: HedgerowError, request_id: str | None = None) -> None:
        super().__init__(error.message, code=error.code, param=error.param,
                         retry_after=error.retry_after)
        self.original = error
        self.request_id = request_id
        self.anthropic_type = anthropic_error_type(error.error_type, error.status)
        self.status = (ANTHROPIC_OVERLOADED_STATUS if self.anthropic_type == "overloaded_error"
                       else error.status)
        self.error_type = error.error_type

    def envelope(self) -> dict[str, Any]:
        return anthropic_error_body(self.message, self.anthropic_type, self.request_id)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return self.original.headers()


class EmbeddingsUnavailable(HedgerowError):
    """The embedding model is not running, is loading, or its queue is full."""

    status = 503
    error_type = "service_unavailable"
    default_code = "embeddings_unavailable"
