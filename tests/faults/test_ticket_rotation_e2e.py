"""A gateway process (uvloop, the CLI flag) rotates its TCP ticket keys.

``--tls-ticket-rotation-s 2``: a ticket taken just after a period begins
resumes one rotation later and not two; ``/metrics`` counts the rotation
and the tickets opened with the previous key and with none.
"""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_transport import _fetch_over_tls
from tests.support.capped import start_capped_stack
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

PERIOD = 2.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_capped_stack(tmp_path_factory.mktemp("tickets"), 64, "--drain-timeout-s", "1",
                               "--tls-ticket-rotation-s", str(PERIOD))
    try:
        yield stack
    finally:
        stack.stop_all()


def _sleep_until(period: int, offset: float) -> None:
    time.sleep(max(0.0, period * PERIOD + offset - time.monotonic()))


def _tickets(stack: Stack) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(stack.gateway_metrics()):
        for sample in family.samples:
            if sample.name == "hedgerow_tls_tickets_total":
                found[sample.labels["event"]] = sample.value
            elif sample.name == "hedgerow_tls_ticket_key_rotations_total":
                found["rotations"] = sample.value
    return found


def test_gateway_ticket_resumes_after_one_rotation_not_two(stack: Stack) -> None:
    context = ssl.create_default_context(cafile=str(stack.ca_cert))
    context.set_alpn_protocols(["http/1.1"])
    before = _tickets(stack)
    period = math.floor(time.monotonic() / PERIOD) + 1
    _sleep_until(period, 0.05)
    _, ticket, reused, _ = _fetch_over_tls(stack.gateway_port, context, None)
    _, other, _, _ = _fetch_over_tls(stack.gateway_port, context, None)
    assert math.floor(time.monotonic() / PERIOD) == period and not reused
    _sleep_until(period + 1, PERIOD / 2)
    assert _fetch_over_tls(stack.gateway_port, context, ticket)[2]  # one rotation: resumes
    _sleep_until(period + 2, 0.1)
    response, _, resumed, _ = _fetch_over_tls(stack.gateway_port, context, other)
    assert not resumed and response.startswith(b"HTTP/1.1 200")  # a full handshake, served
    after = _tickets(stack)
    assert after["rotations"] - before.get("rotations", 0) >= 2
    assert after["opened_previous"] - before.get("opened_previous", 0) >= 1
    assert after["opened_unknown"] - before.get("opened_unknown", 0) >= 1
