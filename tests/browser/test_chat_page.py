"""The chat page at ``GET /`` in headless Chromium, over HTTP/2 and HTTP/3.

What a user sees: tokens appear one after another, TTFT, tokens/s, the
protocol, the gateway's headers; Stop aborts the request and the worker stops
generating; a stream that breaks shows its error; the page works with the
keyboard alone on a phone-sized screen.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser.conftest import BREAKS, LONG_TOKENS, MODEL, SHORT, SHORT_TOKENS
from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

MILLISECONDS = re.compile(r"^\d+ ms$")
REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")
RESUME_GRACE_S = 5.0  # policies/default.yaml streams.resume_grace_ms

# Records the answer's length, and when, at every DOM change of the output region.
WATCH_OUTPUT = """() => {
  window.lengths = []; window.times = [];
  const output = document.getElementById("output");
  new MutationObserver(() => {
    window.lengths.push(output.textContent.length); window.times.push(performance.now());
  }).observe(output, {childList: true, characterData: true, subtree: true});
}"""


def open_chat(browser: Browser, url: str, **context: Any) -> Page:
    page = browser.new_context(**context).new_page()
    page.goto(url)
    expect(page.locator("#model option")).to_have_count(3)  # the picker lists /v1/models
    return page


def generation_counts(stack: Stack) -> tuple[int, int, int]:
    status = stack.worker_status("sim-long")
    return status["active"], status["generations_total"], status["cancelled_total"]


def stream_then_stop(stack: Stack, page: Page) -> None:
    """Send to the slow model, see tokens arrive, press Stop, see the worker stop."""
    page.select_option("#model", MODEL)
    page.evaluate(WATCH_OUTPUT)
    _, generations, cancelled = generation_counts(stack)
    page.get_by_role("button", name="Send").click()
    page.wait_for_function("() => window.lengths.length >= 12", timeout=10_000)
    expect(page.locator("#status")).to_have_text("streaming")
    expect(page.locator("#ttft")).to_have_text(MILLISECONDS)
    page.get_by_role("button", name="Stop").click()
    expect(page.locator("#status")).to_have_text("stopped")
    lengths: list[int] = page.evaluate("window.lengths")
    times: list[float] = page.evaluate("window.times")
    # Incremental: many distinct states, each longer than the one before,
    # spread over the time the tokens took (30 ms each), not one burst.
    assert len(set(lengths)) >= 12 and lengths == sorted(lengths), lengths
    assert times[11] - times[0] > 150, times
    assert lengths[-1] < len("tok0 ") * LONG_TOKENS  # far from the whole answer
    # The worker's generation ended as cancelled, well before its minute was up,
    # and sooner than the resume grace (5 s) that keeps a stream whose client
    # merely went away: Stop cancels it explicitly.
    wait_for(lambda: generation_counts(stack) == (0, generations + 1, cancelled + 1),
             "the worker to cancel the generation", timeout=RESUME_GRACE_S - 2)
    shown = page.locator("#output").text_content()
    time.sleep(0.3)
    assert page.locator("#output").text_content() == shown
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()


def test_http2_tokens_appear_incrementally_and_stop_cancels_the_worker(
        stack: Stack, h2_browser: Browser, page_url: str) -> None:
    page = open_chat(h2_browser, page_url)
    expect(page.locator("#protocol")).to_have_text("h2")
    stream_then_stop(stack, page)


def test_http3_page_reports_h3_and_stop_cancels_the_worker(
        stack: Stack, h3_browser: Browser, page_url: str) -> None:
    page = open_chat(h3_browser, page_url)
    expect(page.locator("#protocol")).to_have_text("h3")
    nav_protocol = page.evaluate(
        "performance.getEntriesByType('navigation')[0].nextHopProtocol")
    assert nav_protocol == "h3"
    stream_then_stop(stack, page)
    expect(page.locator("#protocol")).to_have_text("h3")


def test_a_whole_answer_shows_its_stats_and_gateway_headers(
        h2_browser: Browser, page_url: str) -> None:
    page = open_chat(h2_browser, page_url)
    page.select_option("#model", SHORT)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_have_text("done", timeout=10_000)
    expected = "".join(f"tok{i} " for i in range(1, SHORT_TOKENS + 1))
    expect(page.locator("#output")).to_have_text(expected)
    expect(page.locator("#tokens")).to_have_text(str(SHORT_TOKENS))  # from usage
    # Max tokens, when given, bounds the answer.
    page.get_by_label("Max tokens").fill("5")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_have_text("done", timeout=10_000)
    expect(page.locator("#output")).to_have_text("tok1 tok2 tok3 tok4 tok5 ")
    expect(page.locator("#tokens")).to_have_text("5")
    expect(page.locator("#ttft")).to_have_text(MILLISECONDS)
    rate = float(page.locator("#rate").text_content() or "0")
    assert 5 < rate < 500, rate  # 20 ms a token: about 50, give or take a loaded machine
    expect(page.locator("#cache")).to_have_text("miss")
    expect(page.locator("#hedged")).to_have_text("no")
    expect(page.locator("#worker")).to_have_text("sim-short")
    expect(page.locator("#request-id")).to_have_text(REQUEST_ID)
    expect(page.locator("#protocol")).to_have_text("h2")
    expect(page.locator("#error")).to_be_empty()


def test_a_stream_that_breaks_shows_its_error_event(h2_browser: Browser, page_url: str) -> None:
    page = open_chat(h2_browser, page_url)
    page.select_option("#model", BREAKS)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_have_text("failed", timeout=10_000)
    expect(page.get_by_role("alert")).to_contain_text("Error:")


def test_phone_sized_keyboard_only(stack: Stack, h2_browser: Browser, page_url: str) -> None:
    page = open_chat(h2_browser, page_url, viewport={"width": 375, "height": 667},
                     is_mobile=True, has_touch=True, device_scale_factor=2)
    # Nothing wider than the screen; every control labelled and on screen.
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    for control in (page.get_by_label("Model"), page.get_by_label("Message"),
                    page.get_by_role("button", name="Send"), page.get_by_role("button", name="Stop")):
        expect(control).to_be_visible()
        box = control.bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 375
    expect(page.get_by_role("log")).to_have_attribute("aria-live", "polite")
    # Keyboard alone: pick the model, type, Ctrl+Enter sends, Escape stops.
    page.get_by_label("Model").focus()
    page.select_option("#model", MODEL)
    page.get_by_label("Message").focus()
    page.keyboard.press("Control+a")
    page.keyboard.type("Tell me about foxes.")
    page.keyboard.press("Control+Enter")
    expect(page.locator("#status")).to_have_text("streaming")
    expect(page.get_by_role("log")).to_have_attribute("aria-busy", "true")
    expect(page.locator("#output")).not_to_be_empty()
    page.keyboard.press("Escape")
    expect(page.locator("#status")).to_have_text("stopped")
    expect(page.get_by_role("log")).to_have_attribute("aria-busy", "false")
    wait_for(lambda: generation_counts(stack)[0] == 0, "the worker to go idle",
             timeout=RESUME_GRACE_S - 2)


def test_sse_parser_handles_ids_comments_and_split_chunks(
        h2_browser: Browser, page_url: str) -> None:
    page = open_chat(h2_browser, page_url)
    events = page.evaluate("""() => {
      const parser = new window.hedgerow.SseParser();
      const chunks = [": heartbeat\\n\\n", "id: 7\\r", "\\ndata: {\\"a\\"", ":1}\\r\\n\\r\\n",
                      ":ping\\n", "event: error\\ndata: line one\\ndata:line two\\n\\n",
                      "id: 8\\ndata: [DONE]\\n", "\\n"];
      return chunks.flatMap(chunk => parser.feed(chunk));
    }""")
    assert events == [
        {"type": "message", "data": '{"a":1}', "id": "7"},
        {"type": "error", "data": "line one\nline two", "id": "7"},
        {"type": "message", "data": "[DONE]", "id": "8"},
    ]


def _sse(*events: tuple[int, str]) -> str:
    return "".join(f'id: {i}\ndata: {{"choices": [{{"index": 0, "delta": {{"content": "{text}"}}}}]}}\n\n'
                   for i, text in events)


def test_a_cut_stream_is_resumed_from_its_last_event_id(h2_browser: Browser, page_url: str) -> None:
    """The page's side of resumable streams, against a scripted gateway: the
    first response ends without ``[DONE]`` (the network cut it), so the page
    asks for the rest with ``Last-Event-ID`` and shows one seamless answer."""
    page = open_chat(h2_browser, page_url)
    request_id = "ab" * 16
    resumes: list[tuple[str, str | None]] = []
    sse = {"content-type": "text/event-stream", "x-request-id": request_id}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers=sse, body=": heartbeat\n\n" + _sse((1, "one "), (2, "two "), (3, "three "))))

    def rest(route: Any) -> None:
        resumes.append((route.request.url, route.request.headers.get("last-event-id")))
        route.fulfill(status=200, headers=sse, body=_sse((4, "four "), (5, "five")) + "data: [DONE]\n\n")

    page.route("**/v1/chat/completions/*/events", rest)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_have_text("done")
    expect(page.locator("#output")).to_have_text("one two three four five")
    assert resumes == [(f"{page_url}v1/chat/completions/{request_id}/events", "3")]

    # A stream that can no longer be resumed (expired: 410) says so.
    refused: list[str] = []

    def expired(route: Any) -> None:
        refused.append(route.request.url)
        route.fulfill(status=410, headers={"content-type": "application/json"},
                      body='{"error": {"message": "stream expired", "type": "invalid_request_error"}}')

    page.unroute("**/v1/chat/completions/*/events")
    page.route("**/v1/chat/completions/*/events", expired)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_have_text("failed")
    expect(page.get_by_role("alert")).to_contain_text("410")
    expect(page.get_by_role("alert")).to_contain_text("stream expired")
    assert len(refused) == 1  # final: not retried


# Collects the page's CSP violations from its first script on.
RECORD_VIOLATIONS = """window.violations = [];
document.addEventListener("securitypolicyviolation",
  (event) => window.violations.push(event.violatedDirective + " " + event.blockedURI));"""


def test_the_page_works_under_its_content_security_policy(
        h2_browser: Browser, page_url: str) -> None:
    context = h2_browser.new_context()
    context.add_init_script(RECORD_VIOLATIONS)
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    response = page.goto(page_url)
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "'unsafe-inline'" not in csp
    assert response.headers["x-content-type-options"] == "nosniff"
    expect(page.locator("#model option")).to_have_count(3)  # its script ran and fetched
    page.select_option("#model", SHORT)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_have_text("done", timeout=10_000)
    expect(page.locator("#output")).to_have_text(
        "".join(f"tok{i} " for i in range(1, SHORT_TOKENS + 1)))
    # Its styles applied: the output region keeps its white-space rule.
    assert page.eval_on_selector("#output", "e => getComputedStyle(e).whiteSpace") == "pre-wrap"
    assert page.evaluate("window.violations") == []
    assert not [line for line in console if "Content Security Policy" in line], console
    # And the policy is enforced: an injected inline script does not run.
    page.evaluate("""() => { const s = document.createElement("script");
        s.textContent = "window.injected = true"; document.body.append(s); }""")
    assert page.evaluate("window.injected === undefined")
    assert any(v.startswith("script-src") for v in page.evaluate("window.violations"))
    context.close()
