"""CORS: the policy section's rules and the middleware in front of the gateway app."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.edge.cors import CorsMiddleware
from hedgerow.asgi import Receive, Router, Scope, Send, send_json
from policies.loader import parse_policy_document
from policies.schema import Cors, Policy, PolicyError

APP_ORIGIN = "https://app.example.com"


class RecordingApp:
    """Stands in for the gateway app: answers 200 with the headers the gateway sets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append(f"{scope['method']} {scope['path']}")
        await send_json(send, 200, {"ok": True}, [(b"x-request-id", b"abc"),
                                                  (b"x-hedgerow-cache", b"miss")])


def client_for(cors: Cors) -> tuple[httpx.AsyncClient, RecordingApp, CorsMiddleware]:
    app = RecordingApp()
    middleware = CorsMiddleware(app, cors)
    transport = httpx.ASGITransport(app=middleware)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="https://gw.example"), app, middleware


def preflight_headers(origin: str, method: str = "POST", headers: str = "content-type") -> dict[str, str]:
    return {"origin": origin, "access-control-request-method": method,
            "access-control-request-headers": headers}


@pytest.mark.anyio
async def test_preflight_is_answered_without_reaching_the_app() -> None:
    client, app, _ = client_for(Cors(allow_origins=(APP_ORIGIN,), max_age_s=300))
    async with client:
        response = await client.options("/v1/chat/completions", headers=preflight_headers(
            APP_ORIGIN, headers="content-type, authorization, last-event-id"))
    assert response.status_code == 204
    assert response.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in response.headers["access-control-allow-headers"].split(",")}
    assert {"content-type", "authorization", "last-event-id"} <= allowed
    assert response.headers["access-control-max-age"] == "300"
    assert "origin" in response.headers["vary"].lower()
    assert "access-control-allow-credentials" not in response.headers
    assert app.calls == []


@pytest.mark.anyio
async def test_a_preflight_for_a_path_the_app_does_not_serve_is_its_404() -> None:
    router = Router()
    router.add("POST", "/v1/chat/completions", lambda request: send_json(request.send, 200, {}))
    middleware = CorsMiddleware(router.serve, Cors(allow_origins=(APP_ORIGIN,)), router.serves)
    transport = httpx.ASGITransport(app=middleware)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="https://gw.example") as client:
        served = await client.options("/v1/chat/completions",
                                      headers=preflight_headers(APP_ORIGIN))
        unknown = await client.options("/metrics", headers=preflight_headers(APP_ORIGIN, "GET"))
    assert served.status_code == 204
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert "access-control-allow-methods" not in unknown.headers


@pytest.mark.anyio
@pytest.mark.parametrize(("origin", "method", "headers"), [
    ("https://evil.example", "POST", "content-type"),   # origin not listed
    (APP_ORIGIN, "DELETE", "content-type"),              # method not allowed
    (APP_ORIGIN, "POST", "content-type, x-secret"),      # a header not allowed
    ("null", "POST", "content-type"),                    # sandboxed/file pages
])
async def test_refused_preflight_is_403_and_grants_nothing(origin: str, method: str,
                                                           headers: str) -> None:
    client, app, _ = client_for(Cors(allow_origins=(APP_ORIGIN,)))
    async with client:
        response = await client.options("/v1/chat/completions",
                                        headers=preflight_headers(origin, method, headers))
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in response.headers
    assert app.calls == []


@pytest.mark.anyio
async def test_allowed_origin_gets_its_origin_and_exposed_headers() -> None:
    client, app, _ = client_for(Cors(allow_origins=(APP_ORIGIN,)))
    async with client:
        response = await client.get("/v1/models", headers={"origin": APP_ORIGIN})
    assert response.status_code == 200 and app.calls == ["GET /v1/models"]
    assert response.headers["access-control-allow-origin"] == APP_ORIGIN
    exposed = {h.strip() for h in response.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "x-hedgerow-cache", "x-hedgerow-hedged", "x-hedgerow-worker"} <= exposed
    assert response.headers["vary"] == "Origin"


@pytest.mark.anyio
async def test_disallowed_origin_is_refused_before_any_work() -> None:
    client, app, _ = client_for(Cors(allow_origins=(APP_ORIGIN,)))
    async with client:
        response = await client.post("/v1/chat/completions", content=b"{}",
                                     headers={"origin": "https://evil.example",
                                              "content-type": "text/plain"})
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers
    assert app.calls == []


@pytest.mark.anyio
async def test_same_origin_and_originless_requests_pass_untouched() -> None:
    client, app, _ = client_for(Cors())  # no origin allowed at all
    async with client:
        same = await client.post("/v1/chat/completions", content=b"{}",
                                 headers={"origin": "https://gw.example"})
        plain = await client.get("/v1/models")
    assert same.status_code == plain.status_code == 200
    assert "access-control-allow-origin" not in same.headers
    assert len(app.calls) == 2


@pytest.mark.anyio
async def test_credentials_name_the_exact_origin_never_a_wildcard() -> None:
    client, _, _ = client_for(Cors(allow_origins=(APP_ORIGIN,), allow_credentials=True))
    async with client:
        simple = await client.get("/v1/models", headers={"origin": APP_ORIGIN})
        pre = await client.options("/v1/models", headers=preflight_headers(APP_ORIGIN, "GET"))
    for response in (simple, pre):
        assert response.headers["access-control-allow-origin"] == APP_ORIGIN
        assert response.headers["access-control-allow-credentials"] == "true"


@pytest.mark.anyio
async def test_wildcard_without_credentials_answers_star() -> None:
    client, _, _ = client_for(Cors(allow_origins=("*",)))
    async with client:
        response = await client.get("/v1/models", headers={"origin": "https://any.example"})
    assert response.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in response.headers
    assert "vary" not in response.headers


def test_policy_refuses_wildcard_with_credentials_and_bad_origins() -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy_document("cors:\n  allow_origins: ['*']\n  allow_credentials: true\n", "p.yaml")
    assert "cors.allow_credentials" in str(caught.value) and ":3:" in str(caught.value)
    for bad in ("https://app.example.com/", "app.example.com", "https://App.example.com",
                "null", "https://a.example/path"):
        with pytest.raises(PolicyError):
            parse_policy_document(f"cors:\n  allow_origins: ['{bad}']\n", "p.yaml")
    with pytest.raises(PolicyError):
        parse_policy_document("cors:\n  allow_headers: ['*']\n", "p.yaml")
    ok = parse_policy_document(
        "cors:\n  allow_origins: ['https://app.example.com:8443', 'http://[::1]:3000']\n"
        "  allow_headers: [Content-Type]\n", "p.yaml")
    assert ok.cors.allow_headers == ("content-type",)


@pytest.mark.anyio
async def test_policy_update_takes_effect_for_the_next_request() -> None:
    client, _, middleware = client_for(Cors())
    headers: dict[str, Any] = preflight_headers(APP_ORIGIN)
    async with client:
        before = await client.options("/v1/chat/completions", headers=headers)
        middleware.apply_policy(Policy(cors=Cors(allow_origins=(APP_ORIGIN,))))
        after = await client.options("/v1/chat/completions", headers=headers)
    assert (before.status_code, after.status_code) == (403, 204)
