"""Tracing across real processes: a client's ``traceparent`` through a gateway
to a llama.cpp worker (the real model), both exporting OTLP/HTTP to a receiver
in the test.

The receiver is a minimal OTLP/HTTP endpoint (``POST /v1/traces``, protobuf)
decoded with ``opentelemetry-proto``; the gateway and the worker are turned on
the standard way (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME`` …).
"""

from __future__ import annotations

import itertools
import os
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support.stack import Stack, wait_for

MODEL = "smollm2-135m-instruct"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


@dataclass
class Receiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def received(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        found: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    found.append(ReceivedSpan(service, span.name, span.trace_id.hex(),
                                              span.span_id.hex(), span.parent_span_id.hex(),
                                              attributes))
        with self.lock:
            self.spans.extend(found)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, str]]:
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.path == "/v1/traces":
                got.take(body)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory,
          receiver: tuple[Receiver, str]) -> Iterator[Stack]:
    _, endpoint = receiver
    stack = Stack(tmp_path_factory.mktemp("traced-stack"))
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    saved = {name: os.environ.get(name) for name in (*traced, "OTEL_SERVICE_NAME")}
    try:
        stack.start_control_plane(lease_s=2.0)
        os.environ.update(traced)  # the processes started now inherit it
        os.environ["OTEL_SERVICE_NAME"] = "traced-worker"
        stack.start_worker("llama-traced", "--slots", "1")
        os.environ["OTEL_SERVICE_NAME"] = "traced-gateway"
        stack.start_gateway()
        yield stack
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        stack.stop_all()


def test_a_clients_trace_runs_through_the_gateway_into_the_worker(
    stack: Stack, receiver: tuple[Receiver, str],
) -> None:
    got, _ = receiver
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about foxes."}],
            "max_tokens": 6, "temperature": 0}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01",
               "tracestate": "client=1"}
    with httpx.Client(base_url=stack.gateway_url, timeout=30,
                      verify=ssl.create_default_context(cafile=stack.ca_cert)) as client:
        response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]

    def trace() -> list[ReceivedSpan]:
        return [s for s in got.received() if s.trace_id == CLIENT_TRACE]

    def complete() -> bool:
        names = {(s.service, s.name) for s in trace()}
        return {("traced-gateway", "chat"), ("traced-gateway", "relay"),
                ("traced-worker", "chat"), ("traced-worker", "decode")} <= names

    wait_for(complete, "the gateway's and the worker's spans at the receiver", timeout=30)
    spans = trace()
    [root] = [s for s in spans if s.service == "traced-gateway" and s.name == "chat"]
    assert root.parent_id == CLIENT_PARENT  # under the client's span
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert root.attributes["http.response.status_code"] == 200
    [lookup] = [s for s in spans if s.name == "cache lookup"]
    assert lookup.parent_id == root.span_id
    assert lookup.attributes["hedgerow.cache.result"] == "miss"
    [attempt] = [s for s in spans if s.name == "attempt"]
    assert attempt.parent_id == root.span_id
    assert attempt.attributes["hedgerow.worker.id"] == "llama-traced"
    # The worker continued the trace under the attempt that called it.
    [served] = [s for s in spans if s.service == "traced-worker" and s.name == "chat"]
    assert served.parent_id == attempt.span_id
    phases = {s.name: s for s in spans if s.parent_id == served.span_id}
    assert {"prefill", "decode"} <= set(phases)
    assert phases["decode"].attributes["hedgerow.generation.token_chunks"] >= 1
    assert served.attributes["gen_ai.request.model"] == MODEL


def test_a_cache_hit_is_traced_without_any_attempt(
    stack: Stack, receiver: tuple[Receiver, str],
) -> None:
    got, _ = receiver
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a hedge plant."}],
            "max_tokens": 4, "temperature": 0}
    traces = (f"{n:032x}" for n in itertools.count(1))
    with httpx.Client(base_url=stack.gateway_url, timeout=30,
                      verify=ssl.create_default_context(cafile=stack.ca_cert)) as client:

        def answered_from_cache() -> str | None:
            """The trace id of a request the cache answered (the store may trail the
            first answer by a moment, so a second request may still miss)."""
            trace_id = next(traces)
            response = client.post("/v1/chat/completions", json=body,
                                   headers={"traceparent": f"00-{trace_id}-{CLIENT_PARENT}-01"})
            assert response.status_code == 200, response.text
            return trace_id if response.headers["x-hedgerow-cache"] == "exact" else None

        hit_trace = wait_for(answered_from_cache, "an answer from the cache", timeout=30)

    def spans_of(trace_id: str) -> list[ReceivedSpan]:
        return [s for s in got.received() if s.trace_id == trace_id]

    wait_for(lambda: {"chat", "cache lookup"} <= {s.name for s in spans_of(hit_trace)},
             "the hit's spans at the receiver", timeout=30)
    hit = spans_of(hit_trace)
    assert {s.name for s in hit} == {"chat", "cache lookup"}  # no worker was asked
    [lookup] = [s for s in hit if s.name == "cache lookup"]
    assert lookup.attributes["hedgerow.cache.result"] == "exact"
    [root] = [s for s in hit if s.name == "chat"]
    assert root.attributes["hedgerow.cache"] == "exact"
