"""``hedgerow.tracing`` without the OpenTelemetry packages, and switched off."""

from __future__ import annotations

import logging
import sys

import pytest

from hedgerow import tracing

ASKED = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.test:4318"}


def test_asked_for_without_the_sdk_it_says_so_once_and_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # A module set to None in sys.modules cannot be imported: as if not installed.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with caplog.at_level(logging.INFO, logger="hedgerow.tracing"):
        assert not tracing.setup("hedgerow-gateway", env=ASKED)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "hedgerow[tracing]" in caplog.records[0].getMessage()
    assert not tracing.enabled()


def test_off_every_seam_is_the_shared_no_op() -> None:
    assert not tracing.setup("hedgerow-gateway", env={})
    headers: dict[str, str] = {}
    with tracing.server_span("chat", [(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16
                                       + b"-01")]) as span:
        assert span is tracing.NO_SPAN
        with tracing.span("admission") as child:
            assert child is tracing.NO_SPAN
        attempt = tracing.start_client_span("attempt")
        tracing.inject(attempt, headers)
    assert attempt is tracing.NO_SPAN and headers == {}
    assert tracing.current() is tracing.NO_SPAN


def test_disabled_sdk_wins_over_an_endpoint() -> None:
    assert not tracing.setup("hedgerow-gateway", env={**ASKED, "OTEL_SDK_DISABLED": "true"})
    assert not tracing.enabled()
