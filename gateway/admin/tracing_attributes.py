"""What a gateway request's span says (``hedgerow.tracing``), from what it saw.

Attributes follow the OpenTelemetry GenAI and HTTP semantic conventions where
they fit (``gen_ai.*``, ``http.*``); Hedgerow's own are ``hedgerow.*``. No
prompt or answer text is ever put on a span.
"""

from __future__ import annotations

from typing import Any

from gateway.admin.metrics import RequestMetrics
from hedgerow import tracing
from hedgerow.tracing import AttributeValue


def request_attributes(scope: dict[str, Any], operation: str) -> dict[str, AttributeValue]:
    """Known as the request arrives: what the sampler may look at."""
    return {
        tracing.GEN_AI_OPERATION: operation,
        tracing.GEN_AI_SYSTEM: "hedgerow",
        "http.request.method": str(scope.get("method", "")),
        "url.path": str(scope.get("path", "")),
        "hedgerow.request_id": str(scope.get("hedgerow.request_id", "")),
    }


def describe_request(span: Any, observed: RequestMetrics) -> None:
    """Known as it ends: model, tenant, status, usage, cache, worker, hedged."""
    attributes: dict[str, AttributeValue] = {
        "http.response.status_code": observed.status or 0,
        "hedgerow.tenant": observed.tenant,
        "hedgerow.class": observed.klass,
        "hedgerow.hedged": observed.hedged,
    }
    if observed.model:
        attributes[tracing.GEN_AI_REQUEST_MODEL] = observed.model
    if observed.worker:
        attributes["hedgerow.worker.id"] = observed.worker
    if observed.cache:
        attributes["hedgerow.cache"] = observed.cache
    if observed.usage is not None:
        attributes[tracing.GEN_AI_INPUT_TOKENS] = observed.usage.prompt_tokens
        attributes[tracing.GEN_AI_OUTPUT_TOKENS] = observed.usage.completion_tokens
    if observed.ttft_s is not None:
        attributes["hedgerow.ttft_ms"] = round(observed.ttft_s * 1000, 3)
    span.set_attributes(attributes)
    if observed.error_code or (observed.status or 500) >= 500:
        tracing.failed(span, observed.error_code or f"http_{observed.status}")
