"""Rogue registrations against a real control-plane process.

Anyone who can reach ``POST /v1/workers`` could, before, list a worker as an
external upstream with ``api_key_env`` set — every gateway would then send
that env var's value as a bearer token to a URL of the caller's choosing —
or register a URL that bends the gateway's requests to another host or path.
A real sim worker registers as it always did; each rogue registration gets a
400 naming the field, and never shows up in the registry gateways follow.

With internal mutual TLS the rogue needs a worker certificate first (here: a
worker that joined with a real join token under its own name); it still may
set no operator field, register no URL but an https:// origin, and register
no one but itself.
"""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hedgerow.trust.credentials import TlsContexts
from hedgerow.trust.identity import Identity
from hedgerow.trust.join import JoinOptions, ensure_identity
from tests.support.stack import Stack, free_port

pytestmark = pytest.mark.e2e

ROGUE = "rogue-1"


def registration(**changes: Any) -> dict[str, Any]:
    body = {"worker_id": ROGUE, "url": f"https://127.0.0.1:{free_port()}", "kind": "cpu",
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


def as_worker(stack: Stack, name: str) -> ssl.SSLContext:
    """A worker certificate for ``name``, bought with the stack's worker join token."""
    token_file = Path(stack.join_args("worker")[3])
    creds = ensure_identity(JoinOptions(
        identity=Identity("worker", name), identity_dir=stack.root / f"identity-{name}",
        control_plane=stack.control_plane_url, join_url=stack.join_url,
        token=token_file.read_text().strip(), ca_file=stack.cluster_ca),
        datetime.datetime.now(datetime.UTC))
    return TlsContexts(creds).client()


def post(stack: Stack, body: dict[str, Any], name: str = ROGUE) -> httpx.Response:
    """``POST /v1/workers`` with the certificate of worker ``name``."""
    return httpx.post(stack.control_plane_url + "/v1/workers", json=body,
                      verify=as_worker(stack, name))


def test_a_real_worker_still_registers_as_a_plain_worker(stack: Stack) -> None:
    record = stack.worker("sim-honest")
    assert record is not None
    registration = record["registration"]
    assert registration["external"] is False and registration["api_key_env"] is None
    assert registration["url"].startswith("https://127.0.0.1:")


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
    ("https://127.0.0.1:9/admin?x=", "query or a fragment"),
    ("https://127.0.0.1:9#", "query or a fragment"),
    ("https://127.0.0.1:9/internal", "must not have a path"),
    ("https://gateway-key@127.0.0.1:9", "user or password"),
    ("https://169.254.169.254", "explicit port"),
    ("gopher://127.0.0.1:70", "http:// or https://"),
    ("https://127.0.0.1:9/\r\nx-injected: 1", "control characters"),
    ("https://" + "a" * 300 + ":1", "at most 256"),
])
def test_a_url_that_is_not_an_origin_is_refused(stack: Stack, url: str, why: str) -> None:
    response = post(stack, registration(url=url))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "url" and why in error["message"], error
    assert stack.worker(ROGUE) is None


def test_a_plain_http_url_is_refused_under_mutual_tls(stack: Stack) -> None:
    # Gateways call workers over mutual TLS only.
    response = post(stack, registration(url=f"http://127.0.0.1:{free_port()}"))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_worker_url"
    assert stack.worker(ROGUE) is None


def test_a_worker_registers_no_one_but_itself(stack: Stack) -> None:
    honest = stack.worker("sim-honest")
    assert honest is not None
    response = post(stack, registration(worker_id="sim-honest"))
    assert response.status_code == 403, response.text
    after = stack.worker("sim-honest")
    assert after is not None and after["registration"] == honest["registration"]
    gone = httpx.delete(stack.control_plane_url + "/v1/workers/sim-honest",
                        verify=as_worker(stack, ROGUE))
    assert gone.status_code == 403 and stack.worker("sim-honest") is not None


def test_a_registration_like_a_previous_release_sent_is_accepted(stack: Stack) -> None:
    """Its operator fields at their defaults grant nothing: accepted, stored as a worker."""
    body = registration(worker_id="older-worker", url="https://127.0.0.1:9/",
                        external=False, model_map={}, api_key_env=None)
    response = post(stack, body, name="older-worker")
    assert response.status_code == 201, response.text
    record = stack.worker("older-worker")
    assert record is not None and record["registration"]["url"] == "https://127.0.0.1:9"
    assert record["registration"]["external"] is False
    assert httpx.delete(stack.control_plane_url + "/v1/workers/older-worker",
                        verify=as_worker(stack, "older-worker")).status_code == 200
    assert stack.worker("older-worker") is None
