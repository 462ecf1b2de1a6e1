"""OpenTelemetry tracing at a few seams of the request path, off by default.

Off (the default) every call here is one module-global check that returns a
shared do-nothing span (``NO_SPAN``): no allocation per request, no SDK
imported. ``setup`` turns it on, the standard way, from the environment:

- on when ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
  or ``OTEL_TRACES_EXPORTER`` (``otlp`` or ``console``; ``none`` keeps it off)
  is set, unless ``OTEL_SDK_DISABLED=true``;
- the SDK itself reads the rest: ``OTEL_SERVICE_NAME`` and
  ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]`` (the default is
  ``parentbased_always_on``: a client's sampled flag is obeyed),
  ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`` / ``_TIMEOUT``, ``OTEL_BSP_*``.

Export is OTLP over HTTP/protobuf (``opentelemetry-exporter-otlp-proto-http``,
the ``hedgerow[tracing]`` extra). Without the packages, tracing asked for is
reported once in the log and stays off; nothing else changes.

W3C ``traceparent``/``tracestate`` are read from a client's request
(``server_span``) and written on each request to a worker or an external
upstream (``inject``), with the attempt's span as the parent, so a worker's
spans (``workers.app``: prefill, decode) hang under the attempt that asked.

Spans are made current through ``contextvars`` (the SDK's context), so a task
started inside a span (a hedge, the generation beside the client's reader)
parents its own spans there; an attempt's span, which outlives the block that
opened it, is handed on explicitly (``Attempt.span``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

log = logging.getLogger("hedgerow.tracing")

AttributeValue = str | bool | int | float

# GenAI semantic conventions (opentelemetry semconv, gen_ai.*), kept as plain
# names so the gateway needs no semconv package.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"

_TRUE = ("1", "true", "yes", "on")


class NoSpan:
    """The span when tracing is off: every method the seams call, doing nothing;
    its own context manager, so an unrecorded ``with`` allocates nothing."""

    def __enter__(self) -> NoSpan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        return None

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        return None

    def add_event(self, name: str, attributes: Mapping[str, AttributeValue] | None = None,
                  timestamp: int | None = None) -> None:
        return None

    def is_recording(self) -> bool:
        return False

    def end(self, end_time: int | None = None) -> None:
        return None


NO_SPAN = NoSpan()

_tracer: Any = None  # an SDK Tracer once ``setup`` turned tracing on
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for tracing (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(service_name: str, *, exporter: Any = None, batch: bool = False,
          env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on if the environment asks for it (or ``exporter`` is given:
    tests pass an in-memory one, exported span by span unless ``batch``, as the
    OTLP exporter is); True when on.

    ``service_name`` is the default for ``OTEL_SERVICE_NAME``."""
    global _tracer, _provider
    env = os.environ if env is None else env
    if exporter is None and not wanted(env):
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        log.warning("tracing was asked for (OTEL_* variables) but the OpenTelemetry SDK is "
                    "not installed: install hedgerow[tracing]; tracing stays off")
        return False
    resource = Resource.create({} if env.get("OTEL_SERVICE_NAME")
                               else {SERVICE_NAME: service_name})
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch
                                    else SimpleSpanProcessor(exporter))
    else:
        built = _exporter(env)
        if built is None:
            return False
        provider.add_span_processor(BatchSpanProcessor(built))
    _provider, _tracer = provider, provider.get_tracer("hedgerow")
    log.info("tracing on: service %s, exporter %s", resource.attributes.get(SERVICE_NAME),
             type(exporter or built).__name__)
    return True


def _exporter(env: Mapping[str, str]) -> Any:
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if kind != "otlp":
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); "
                    "tracing stays off", kind)
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        log.warning("tracing was asked for but opentelemetry-exporter-otlp-proto-http is "
                    "not installed: install hedgerow[tracing]; tracing stays off")
        return None
    return OTLPSpanExporter()  # endpoint, headers, timeout from OTEL_EXPORTER_OTLP_*


def shutdown() -> None:
    """Flush what is batched and stop (the process is ending); tracing is off after."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def span(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Any:
    """A child of the current span, current inside the ``with``; an exception that
    leaves it marks it an error. Off: a shared do-nothing context manager."""
    tracer = _tracer
    if tracer is None:
        return NO_SPAN
    return tracer.start_as_current_span(name, attributes=attributes)


def server_span(name: str, headers: Iterable[tuple[bytes, bytes]],
                attributes: Mapping[str, AttributeValue] | None = None) -> Any:
    """The span of a request received (``headers`` as ASGI gives them): a child of
    the caller's ``traceparent`` when it sent one, else a new trace's root."""
    tracer = _tracer
    if tracer is None:
        return NO_SPAN
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind
    carrier = {bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1")
               for k, v in headers if bytes(k).lower() in (b"traceparent", b"tracestate")}
    parent = propagate.extract(carrier) if carrier else None
    return tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                        attributes=attributes)


def start_client_span(name: str, attributes: Mapping[str, AttributeValue] | None = None) -> Any:
    """A span to end by hand (``.end()``), a child of the current one: a call to a
    worker, which lives on after the block that started it."""
    tracer = _tracer
    if tracer is None:
        return NO_SPAN
    from opentelemetry.trace import SpanKind
    return tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)


def inject(span_: Any, headers: MutableMapping[str, str]) -> None:
    """Write ``traceparent`` (and ``tracestate``) for a request made within ``span_``;
    an unsampled span's too (flag ``00``), so the worker does not record it either."""
    if _tracer is None:
        return
    from opentelemetry import propagate, trace
    propagate.inject(headers, context=trace.set_span_in_context(span_))


def current() -> Any:
    """The current span (``NO_SPAN`` when off)."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace
    return trace.get_current_span()


def failed(span_: Any, error: BaseException | str) -> None:
    """Mark ``span_`` an error (``error.type``: the error's code or class)."""
    if not span_.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode
    code = error if isinstance(error, str) else getattr(error, "code", None)
    kind = code if isinstance(code, str) else type(error).__name__
    span_.set_attribute("error.type", kind)
    span_.set_status(Status(StatusCode.ERROR, kind))


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as the epoch nanoseconds a span's times take."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def record_span(name: str, start_monotonic: float, end_monotonic: float,
                attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """A finished child span of the current one, from times already taken (a
    worker's prefill and decode, known once the generation is over)."""
    tracer = _tracer
    if tracer is None:
        return
    child = tracer.start_span(name, start_time=wall_ns(start_monotonic), attributes=attributes)
    child.end(end_time=wall_ns(end_monotonic))
