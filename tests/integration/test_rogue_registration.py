"""Rogue registrations against a real control-plane process.

Anyone who can reach ``POST /v1/workers`` could, before, list a worker as an
external upstream with ``api_key_env`` set — every gateway would then send
that env var's value as a bearer token to a URL of the caller's choosing —
or register a URL that bends the gateway's requests to another host or path.
A real sim worker registers as it always did; each rogue registration gets a
400 naming the field, and never shows up in the registry gateways follow.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.stack import Stack, free_port

pytestmark = pytest.mark.e2e

ROGUE = "rogue-1"


def registration(**changes: Any) -> dict[str, Any]:
    body = {"worker_id": ROGUE, "url": f"http://127.0.0.1:{free_port()}", "kind": "cpu",
            "models": ["smollm2-135m-instruct"], "slots": 4}
    return {**body, **changes}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("rogue"))
    try:
        stack.start_control_plane(lease_s=30.0)
        stack.start_worker("sim-honest", "--backend", "sim", "--slots", "1")
        yield stack
    finally:
        stack.stop_all()


def post(stack: Stack, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(stack.control_plane_url + "/v1/workers", json=body)


def test_a_real_worker_still_registers_as_a_plain_worker(stack: Stack) -> None:
    record = stack.worker("sim-honest")
    assert record is not None
    registration = record["registration"]
    assert registration["external"] is False and registration["api_key_env"] is None
    assert registration["url"].startswith("http://127.0.0.1:")


@pytest.mark.parametrize(("field", "value"), [
    ("external", True),
    ("api_key_env", "HEDGEROW_ADMIN_TOKEN"),
    ("model_map", {"smollm2-135m-instruct": "gpt-4o"}),
])
def test_an_operators_field_is_refused_by_name(stack: Stack, field: str, value: Any) -> None:
    response = post(stack, registration(**{field: value}))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == "field_not_allowed"
    assert f"{field} cannot be set by a worker registration" in error["message"]
    assert stack.worker(ROGUE) is None


@pytest.mark.parametrize(("url", "why"), [
    ("http://127.0.0.1:9/admin?x=", "query or a fragment"),
    ("http://127.0.0.1:9#", "query or a fragment"),
    ("http://127.0.0.1:9/internal", "must not have a path"),
    ("http://gateway-key@127.0.0.1:9", "user or password"),
    ("http://169.254.169.254", "explicit port"),
    ("gopher://127.0.0.1:70", "http:// or https://"),
    ("http://127.0.0.1:9/\r\nx-injected: 1", "control characters"),
    ("http://" + "a" * 300 + ":1", "at most 256"),
])
def test_a_url_that_is_not_an_origin_is_refused(stack: Stack, url: str, why: str) -> None:
    response = post(stack, registration(url=url))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "url" and why in error["message"], error
    assert stack.worker(ROGUE) is None


def test_a_registration_like_a_previous_release_sent_is_accepted(stack: Stack) -> None:
    """Its operator fields at their defaults grant nothing: accepted, stored as a worker."""
    body = registration(worker_id="older-worker", url="http://127.0.0.1:9/",
                        external=False, model_map={}, api_key_env=None)
    response = post(stack, body)
    assert response.status_code == 201, response.text
    record = stack.worker("older-worker")
    assert record is not None and record["registration"]["url"] == "http://127.0.0.1:9"
    assert record["registration"]["external"] is False
    assert httpx.delete(stack.control_plane_url + "/v1/workers/older-worker").status_code == 200
