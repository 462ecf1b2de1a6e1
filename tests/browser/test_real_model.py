"""The chat page against the real bundled model (llama.cpp on the CPU).

One happy path, as a user would try it after ``make run``: pick the model,
send the default prompt, read a streamed answer. With
``HEDGEROW_CHAT_SCREENSHOT=docs/chat-page.png`` it also refreshes the README's
screenshot, taken mid-stream.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, expect

from tests.browser.conftest import MODEL
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

MAX_TOKENS = 40  # bounds the answer (and the test) on a busy 2-core machine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("real-model"))
    try:
        stack.start_control_plane()
        stack.start_worker("cpu-1")
        stack.start_gateway("--gateway-id", "gw-browser")
        yield stack
    finally:
        stack.stop_all()


def test_the_real_model_streams_an_answer_into_the_page(
        h2_browser: Browser, page_url: str) -> None:
    context = h2_browser.new_context(viewport={"width": 720, "height": 760})
    page = context.new_page()
    page.goto(page_url)
    expect(page.locator("#model option")).to_have_count(1)
    expect(page.locator("#model")).to_have_value(MODEL)
    page.evaluate("""() => {
      window.lengths = [];
      const output = document.getElementById("output");
      new MutationObserver(() => window.lengths.push(output.textContent.length))
        .observe(output, {childList: true, characterData: true, subtree: true});
    }""")
    page.get_by_label("Max tokens").fill(str(MAX_TOKENS))
    page.get_by_role("button", name="Send").click()
    page.wait_for_function("() => window.lengths.length >= 8", timeout=60_000)
    target = os.environ.get("HEDGEROW_CHAT_SCREENSHOT")
    if target:  # a few lines into the answer, still streaming
        page.wait_for_function("() => window.lengths.length >= 20", timeout=60_000)
        page.screenshot(path=str(Path(target)))
    expect(page.locator("#status")).to_have_text("done", timeout=120_000)
    lengths: list[int] = page.evaluate("window.lengths")
    assert len(set(lengths)) >= 8 and lengths == sorted(lengths)
    answer = page.locator("#output").text_content() or ""
    assert len(answer.split()) >= 3, answer
    assert 8 <= int(page.locator("#tokens").text_content() or "0") <= MAX_TOKENS
    expect(page.locator("#ttft")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#protocol")).to_have_text("h2")
    expect(page.locator("#worker")).to_have_text("cpu-1")
    expect(page.locator("#error")).to_be_empty()
