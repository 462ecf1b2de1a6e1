"""CORS as Chromium enforces it, following the control plane's policy; IPv6.

The page is loaded from ``https://localhost:PORT`` and calls the same gateway
as ``https://127.0.0.1:PORT``: another origin, so every call is cross-origin
and the browser applies the CORS answer the gateway gives. The policy starts
with no origin allowed and is changed through the control plane while the
gateway runs.
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import pytest
from cryptography import x509
from playwright.sync_api import Browser, Page

from tests.browser.conftest import SHORT, policy_text
from tests.support.h3client import h3_request
from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

# Runs in the page; resolves to what the page's script could read, or the error.
CROSS_ORIGIN_CHAT = """async ([url, credentials]) => {
  try {
    const response = await fetch(url + "/v1/chat/completions", {
      method: "POST", credentials,
      headers: {"content-type": "application/json"},
      body: JSON.stringify({model: "%s", max_tokens: 3, stream: true,
                            messages: [{role: "user", content: "hi"}]})});
    return {status: response.status, text: await response.text(),
            requestId: response.headers.get("x-request-id"),
            worker: response.headers.get("x-hedgerow-worker"),
            cache: response.headers.get("x-hedgerow-cache")};
  } catch (error) { return {error: error.name}; }
}""" % SHORT


def apply_policy(stack: Stack, **cors: Any) -> None:
    before = _versions(stack)
    with stack.admin() as admin:
        response = admin.post("/v1/policy", content=policy_text(**cors))
    assert response.status_code in (200, 201), response.text
    wait_for(lambda: _versions(stack) > before, "the gateway to run the new policy", 5)


def _versions(stack: Stack) -> int:
    with stack.admin() as admin:
        status = admin.get("/v1/status").json()
    return max(g["running_version"] or 0 for g in status["gateways"]
               if g["gateway_id"] == "gw-browser")


def gateway(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=f"https://127.0.0.1:{stack.gateway_port}", timeout=10,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def chat_from(page: Page, api: str, credentials: str = "same-origin") -> dict[str, Any]:
    return dict(page.evaluate(CROSS_ORIGIN_CHAT, [api, credentials]))


def test_cross_origin_calls_follow_the_policy_and_its_credentials_rules(
        stack: Stack, h2_browser: Browser, page_url: str) -> None:
    # The chat page stands in for another site's page calling the API. Its own
    # CSP (connect-src 'self') would stop the call before CORS is asked at
    # all; another site's page would have its own policy, so CSP is off here.
    page = h2_browser.new_context(bypass_csp=True).new_page()
    page.goto(page_url)
    api = f"https://127.0.0.1:{stack.gateway_port}"
    origin = page_url.rstrip("/")
    short_before = stack.worker_status("sim-short")["generations_total"]

    # No origin allowed (the default): the browser's preflight is refused, the
    # request itself is never sent, and no generation runs.
    assert chat_from(page, api) == {"error": "TypeError"}
    with gateway(stack) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
    assert preflight.status_code == 403
    assert "access-control-allow-origin" not in preflight.headers
    assert stack.worker_status("sim-short")["generations_total"] == short_before

    # Allow the page's origin: the call works, and the page reads the headers
    # the policy exposes.
    apply_policy(stack, allow_origins=[origin])
    answer = chat_from(page, api)
    assert answer["status"] == 200 and answer["text"].rstrip().endswith("data: [DONE]")
    assert len(answer["requestId"]) == 32
    assert (answer["worker"], answer["cache"]) == ("sim-short", "miss")

    # Credentials need allow_credentials: without it the browser refuses the answer...
    assert chat_from(page, api, "include") == {"error": "TypeError"}
    # ...with it, the gateway names the exact origin and allows them.
    apply_policy(stack, allow_origins=[origin], allow_credentials=True)
    assert chat_from(page, api, "include")["status"] == 200
    with gateway(stack) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert preflight.headers["access-control-allow-credentials"] == "true"


def test_an_origin_not_listed_is_refused_before_any_generation(stack: Stack) -> None:
    apply_policy(stack, allow_origins=["https://app.example.com"])
    before = stack.worker_status("sim-short")["generations_total"]
    with gateway(stack) as client:
        # text/plain needs no preflight: the gateway itself must refuse it.
        response = client.post("/v1/chat/completions", headers={
            "origin": "https://evil.example", "content-type": "text/plain"},
            content=f'{{"model": "{SHORT}", "max_tokens": 3, '
                    '"messages": [{"role": "user", "content": "hi"}]}')
        allowed = client.get("/v1/models", headers={"origin": "https://app.example.com"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in response.headers
    assert stack.worker_status("sim-short")["generations_total"] == before
    assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"


def test_ipv6_loopback_serves_tcp_and_quic_and_advertises_h3(stack: Stack) -> None:
    port = stack.gateway_port
    cert = x509.load_pem_x509_certificate((stack.root / "state" / "tls" / "cert.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")} <= set(
        names.get_values_for_type(x509.IPAddress))

    tls = ssl.create_default_context(cafile=stack.ca_cert)
    with httpx.Client(http2=True, verify=tls) as client:
        tcp = client.get(f"https://[::1]:{port}/healthz")
    assert (tcp.status_code, tcp.http_version) == (200, "HTTP/2")
    assert tcp.headers["alt-svc"].startswith(f'h3=":{port}"')

    # In a thread of its own: Playwright's sync API holds this thread's event loop.
    with ThreadPoolExecutor(1) as thread:
        quic = thread.submit(anyio.run, functools.partial(
            h3_request, "::1", port, path="/healthz", cafile=stack.ca_cert)).result()
    assert quic.status == 200 and b"ok" in quic.body
