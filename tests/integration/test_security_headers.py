"""Security headers on the public port, read off a running gateway (h1 and h2).

The chat page carries a CSP that admits exactly its own inline script and
style (checked by hashing what was served) and nothing else; every response
(page, JSON, SSE, errors) says nosniff, no-referrer and cannot be framed; HSTS
comes over HTTPS for a host name, never for localhost or an IP literal.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.support.stack import Stack
from tests.support.streams import chat_body, client

pytestmark = pytest.mark.e2e

SIM = ["--backend", "sim", "--slots", "2", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "4"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("headers"))
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


def _sha256_source(text: str) -> str:
    return "'sha256-%s'" % base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def _directives(csp: str) -> dict[str, list[str]]:
    parts = (d.split() for d in csp.split(";") if d.strip())
    return {p[0]: p[1:] for p in parts}


def _assert_common(response: httpx.Response) -> None:
    headers = response.headers
    assert headers["x-content-type-options"] == "nosniff", response.request.url
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-frame-options"] == "DENY"
    assert _directives(headers["content-security-policy"])["frame-ancestors"] == ["'none'"]
    assert len(headers.get_list("content-security-policy")) == 1


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_the_page_admits_only_its_own_inline_script_and_style(stack: Stack, http2: bool) -> None:
    with client(stack, http2=http2) as http:
        page = http.get("/")
    assert page.status_code == 200
    _assert_common(page)
    csp = _directives(page.headers["content-security-policy"])
    scripts = re.findall(r"<script>(.*?)</script>", page.text, re.S)
    styles = re.findall(r"<style>(.*?)</style>", page.text, re.S)
    assert len(scripts) == 1 and len(styles) == 1
    assert csp["script-src"] == [_sha256_source(scripts[0])]
    assert csp["style-src"] == [_sha256_source(styles[0])]
    assert csp["default-src"] == ["'none'"] and csp["connect-src"] == ["'self'"]
    assert "'unsafe-inline'" not in page.headers["content-security-policy"]


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_every_api_answer_carries_the_headers(stack: Stack, http2: bool) -> None:
    with client(stack, http2=http2) as http:
        answers = [
            http.get("/v1/models"),
            http.get("/healthz"),
            http.get("/no/such/route"),
            http.post("/v1/chat/completions", json={"stream": "yes"}),
            http.post("/v1/chat/completions", json=chat_body(4)),  # SSE
            http.post("/v1/chat/completions", json={**chat_body(4), "stream": False}),
        ]
    assert [a.status_code for a in answers] == [200, 200, 404, 400, 200, 200]
    for answer in answers:
        _assert_common(answer)
        assert _directives(answer.headers["content-security-policy"])["default-src"] == ["'none'"]
        assert "strict-transport-security" not in answer.headers  # 127.0.0.1: an IP literal


@pytest.mark.parametrize("host, hsts", [("gateway.example", True), ("gateway.example:8443", True),
                                        ("localhost", False), ("127.0.0.1", False),
                                        ("[::1]:8443", False)])
def test_hsts_over_https_for_a_host_name_only(stack: Stack, host: str, hsts: bool) -> None:
    with client(stack) as http:
        answer = http.get("/healthz", headers={"host": host})
    assert answer.status_code == 200
    if hsts:
        assert answer.headers["strict-transport-security"] == "max-age=63072000"
    else:
        assert "strict-transport-security" not in answer.headers
