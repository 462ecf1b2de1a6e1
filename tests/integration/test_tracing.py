"""Tracing of a request's corridor (``hedgerow.tracing``), exported to memory.

The scheduler, dispatcher and generation are the real ones, over the fake
workers of ``test_dispatch`` (one a straggler, so the request is hedged); the
request's own span is opened as ``GatewayApp._complete`` opens it, from the
client's headers. The test reads the spans an operator's collector would get.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hedgerow import tracing
from tests.integration.test_dispatch import (Rig, assert_served_fully, make_policy, running,
                                             wait_until)
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.setup("hedgerow-gateway", exporter=exporter, env={})
    try:
        yield exporter
    finally:
        tracing.shutdown()


async def serve_traced(rig: Rig, headers: list[tuple[bytes, bytes]]) -> None:
    with tracing.server_span("chat", headers, {tracing.GEN_AI_OPERATION: "chat"}):
        served = await rig.serve(rig.ticket())
    assert_served_fully(served)
    assert served.worker_id == "b" and served.hedged


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


async def test_a_hedged_request_is_one_trace_with_sibling_attempts(
    exported: InMemorySpanExporter,
) -> None:
    straggler = Behaviour(first_token_after_s=3.0)
    async with running(make_policy(), {"a": straggler, "b": Behaviour()}) as rig:
        await serve_traced(rig, [(b"traceparent", TRACEPARENT.encode()),
                                 (b"tracestate", b"vendor=1")])
        # The loser's span ends when its stream has been closed, in its own task.
        await wait_until(lambda: len(by_name(list(exported.get_finished_spans()),
                                             "attempt")) == 2)
        spans = list(exported.get_finished_spans())
        [root] = by_name(spans, "chat")
        # The client's trace is continued, under the client's own span.
        assert root.context is not None
        assert format(root.context.trace_id, "032x") == CLIENT_TRACE
        assert format(parent_of(root) or 0, "016x") == CLIENT_PARENT
        assert all(s.context is not None and s.context.trace_id == root.context.trace_id
                   for s in spans)
        children = {s.name for s in spans if parent_of(s) == span_id(root)}
        assert {"admission", "queue wait", "attempt", "relay"} <= children
        primary, hedge = sorted(by_name(spans, "attempt"),
                                key=lambda s: int(attrs(s)["hedgerow.attempt.index"]))
        assert parent_of(primary) == parent_of(hedge) == span_id(root)
        assert attrs(primary)["hedgerow.worker.id"] == "a"
        assert attrs(primary)["hedgerow.attempt.kind"] == "primary"
        assert attrs(primary)["hedgerow.attempt.outcome"] in ("cancelled", "lost")
        assert attrs(hedge)["hedgerow.worker.id"] == "b"
        assert attrs(hedge)["hedgerow.attempt.kind"] == "hedge"
        assert attrs(hedge)["hedgerow.attempt.outcome"] == "success"
        assert [e.name for e in hedge.events] == ["first_token"]
        assert "first_token" in [e.name for e in root.events]
        [relay] = by_name(spans, "relay")
        assert attrs(relay)["hedgerow.worker.id"] == "b"
        assert attrs(relay)[tracing.GEN_AI_OUTPUT_TOKENS] > 0
        # Each worker got the trace, with its own attempt's span as the parent.
        for span, worker in ((primary, "a"), (hedge, "b")):
            [call] = rig.workers.calls_to(worker)
            assert call.headers["traceparent"] == (
                f"00-{CLIENT_TRACE}-{format(span_id(span), '016x')}-01")
            assert call.headers["tracestate"] == "vendor=1"


async def test_a_retry_is_a_sibling_attempt_and_the_failed_one_says_why(
    exported: InMemorySpanExporter,
) -> None:
    policy = make_policy(hedging={"enabled": False})
    async with running(policy, {"a": Behaviour(status=500), "b": Behaviour()}) as rig:
        with tracing.server_span("chat", []):
            served = await rig.serve(rig.ticket())
        assert_served_fully(served)
        assert served.worker_id == "b"
    spans = list(exported.get_finished_spans())
    [root] = by_name(spans, "chat")
    failed, retried = sorted(by_name(spans, "attempt"),
                             key=lambda s: int(attrs(s)["hedgerow.attempt.index"]))
    assert parent_of(failed) == parent_of(retried) == span_id(root)
    assert (attrs(failed)["hedgerow.worker.id"], attrs(failed)["hedgerow.attempt.kind"],
            attrs(failed)["hedgerow.attempt.outcome"]) == ("a", "primary", "failed")
    assert not failed.status.is_ok and attrs(failed)["error.type"] == "upstream_error"
    assert (attrs(retried)["hedgerow.worker.id"], attrs(retried)["hedgerow.attempt.kind"],
            attrs(retried)["hedgerow.attempt.outcome"]) == ("b", "retry", "success")


async def test_without_a_client_traceparent_the_request_starts_a_trace(
    exported: InMemorySpanExporter,
) -> None:
    async with running(make_policy(), {"a": Behaviour(first_token_after_s=3.0),
                                       "b": Behaviour()}) as rig:
        await serve_traced(rig, [])
        [root] = by_name(list(exported.get_finished_spans()), "chat")
        assert root.parent is None and root.context is not None
        [call] = rig.workers.calls_to("b")
        assert call.headers["traceparent"].split("-")[1] == format(root.context.trace_id, "032x")


async def test_a_client_that_does_not_sample_is_obeyed_and_its_decision_passed_on(
    exported: InMemorySpanExporter,
) -> None:
    unsampled = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-00"
    async with running(make_policy(), {"a": Behaviour()}) as rig:
        with tracing.server_span("chat", [(b"traceparent", unsampled.encode())]):
            served = await rig.serve(rig.ticket())
        assert_served_fully(served)
        [call] = rig.workers.calls_to("a")
    assert exported.get_finished_spans() == ()
    version, trace_id, _, flags = call.headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "00")


async def test_tracing_off_sends_no_traceparent_and_records_nothing() -> None:
    assert not tracing.enabled()
    async with running(make_policy(), {"a": Behaviour()}) as rig:
        served = await rig.serve(rig.ticket())
        assert_served_fully(served)
        [call] = rig.workers.calls_to("a")
        assert "traceparent" not in call.headers


def test_the_switch_reads_the_standard_variables() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert not tracing.wanted({"OTEL_SDK_DISABLED": "true",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
