"""Chromium over HTTP/3 to a gateway that Retries every new QUIC connection.

``--quic-retry always`` makes each client prove its address with a token
before any handshake work: a real browser must follow the Retry and still
load the page over h3 (and the gateway must count the Retries it sent).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect
from prometheus_client.parser import text_string_to_metric_families

from tests.browser.conftest import SIM, policy_text
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("browser-retry")
    policy = root / "policy.yaml"
    policy.write_text(policy_text())
    stack = Stack(root)
    try:
        stack.start_control_plane(policy=policy)
        stack.start_worker("sim-1", *SIM, "--slots", "2", "--sim-decode-ms-per-token", "5",
                           "--sim-output-tokens", "8")
        stack.start_gateway("--gateway-id", "gw-retry", "--quic-retry", "always")
        yield stack
    finally:
        stack.stop_all()


def _retries(stack: Stack) -> float:
    for family in text_string_to_metric_families(stack.gateway_metrics()):
        for sample in family.samples:
            if sample.name == "hedgerow_quic_retries_total":
                return sample.value
    raise AssertionError("no hedgerow_quic_retries_total")


def test_chromium_follows_the_retry_and_loads_the_page_over_h3(
        stack: Stack, h3_browser: Browser, page_url: str) -> None:
    before = _retries(stack)
    page = h3_browser.new_context().new_page()
    page.goto(page_url)
    expect(page.locator("#model option")).not_to_have_count(0)
    assert page.evaluate(
        "performance.getEntriesByType('navigation')[0].nextHopProtocol") == "h3"
    assert _retries(stack) > before
