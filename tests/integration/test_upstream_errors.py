"""An upstream's failure reaches a client as Hedgerow's own error, never raw.

The real gateway app, scheduler and dispatcher, called by in-memory ASGI
clients, over ``MockTransport`` workers that fail the ways real ones do: a
500 whose body names the worker's address and a secret, a 401, a 404, a 400,
a garbage body, an SSE error event before or after the first token. For
each, streamed and not, the client must get an OpenAI error envelope (or the
gateway's own SSE error event) with none of: the worker's address, its id,
the secret, the upstream's own words, or an env var's name. The operator's
log must have the detail, with the request id.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import pytest

from gateway.app import GatewayApp
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot, WorkerLoad, WorkerRecord, WorkerRegistration
from tests.integration.test_dispatch import make_policy, running
from tests.support.asgi_client import Client, Gateway, body
from tests.support.fake_workers import Behaviour, record, url_of

pytestmark = pytest.mark.anyio

WORKER = "w-7f3a9c-internal"
ADDRESS = url_of(WORKER).removeprefix("http://")  # w-7f3a9c-internal.worker.test:8000
SECRET = "sk-live-4f9d2e7c1b8a6305"
UPSTREAM_WORDS = "llama_decode failed at ctx 2048"
KEY_ENV = "HEDGEROW_TEST_UPSTREAM_KEY_8c1d"
LEAKS = (ADDRESS, "worker.test", WORKER, SECRET, UPSTREAM_WORDS, KEY_ENV, "8000")

# What a careless upstream says when it fails: everything a client must not read.
NOISY = (f"Internal Server Error at http://{ADDRESS}/v1/chat/completions: {UPSTREAM_WORDS} "
         f"(api_key={SECRET})").encode()
NOISY_ENVELOPE = orjson.dumps({"error": {"message": NOISY.decode(), "type": "server_error",
                                         "code": SECRET}})
ERROR_EVENT = b"data: " + NOISY_ENVELOPE + b"\n\n"


@asynccontextmanager
async def gateway(behaviour: Behaviour,
                  records: list[WorkerRecord] | None = None) -> AsyncIterator[Gateway]:
    """The app over the one fake worker ``WORKER``; no hedges, no retries elsewhere."""
    policy = make_policy(hedging={"enabled": False}, cache={"enabled": False})
    async with running(policy, {WORKER: behaviour}, records) as rig:
        app = GatewayApp(policy, LatestValue(RegistrySnapshot(version=0)), rig.scheduler,
                         rig.dispatcher)
        async with anyio.create_task_group() as tg:
            yield Gateway(app, rig.workers, tg)
            tg.cancel_scope.cancel()


async def ask(behaviour: Behaviour, *, stream: bool,
              records: list[WorkerRecord] | None = None) -> Client:
    async with gateway(behaviour, records) as gw:
        client = await gw.stream(request=body(stream=stream))
        with anyio.fail_after(5):
            await client.finished.wait()
    return client


def assert_no_leak(client: Client) -> None:
    everything = client.raw().decode(errors="replace") + repr(client.sent[0]["headers"])
    # x-hedgerow-worker is the external contract (the worker's id, on a 200 only).
    everything = everything.replace(f"x-hedgerow-worker', b'{WORKER}", "")
    # The request id is ours and random hex: "8000" turns up in about one id in 2,300.
    for name, value in client.sent[0]["headers"]:
        if name == b"x-request-id":
            everything = everything.replace(value.decode(), "<request-id>")
    for leak in LEAKS:
        assert leak not in everything, (leak, everything)


def envelope(client: Client) -> dict[str, Any]:
    error: dict[str, Any] = client.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    return error


# -- before the first token: an HTTP error envelope ----------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize(("name", "behaviour"), [
    ("500 with its address and a secret", Behaviour(status=500, body=NOISY)),
    ("503 with a JSON envelope of its own", Behaviour(status=503, body=NOISY_ENVELOPE)),
    ("401", Behaviour(status=401, body=NOISY_ENVELOPE)),
    ("302 elsewhere", Behaviour(status=302, body=NOISY)),
    ("garbage with a 200", Behaviour(body=b"\x00\xff<html>" + NOISY + b"</html>")),
    ("an SSE error event first", Behaviour(garbage_after_tokens=0, garbage=ERROR_EVENT)),
    ("an event that is no chunk", Behaviour(garbage_after_tokens=0,
                                            garbage=b'data: {"detail": "' + NOISY + b'"}\n\n')),
])
async def test_a_failing_upstream_gives_our_envelope_and_nothing_of_its_own(
    name: str, behaviour: Behaviour, stream: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    client = await ask(behaviour, stream=stream)
    # The only worker failed: retries have nowhere to go, the request gets the 503 of
    # "no worker could serve it" (Retry-After), never the worker's own status or body.
    assert client.status == 503, (name, client.raw())
    error = envelope(client)
    assert error["type"] == "service_unavailable" and error["code"] == "no_healthy_worker"
    assert error["message"].startswith("no worker could serve the request: the model server")
    assert_no_leak(client)
    request_id = client.header("x-request-id")
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert any(WORKER in line for line in logged), caplog.text  # the operator's detail


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_400_from_the_upstream_is_a_generic_400(
    stream: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    client = await ask(Behaviour(status=400, body=NOISY_ENVELOPE), stream=stream)
    assert client.status == 400
    error = envelope(client)
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "upstream_rejected_request"
    assert_no_leak(client)
    assert SECRET in caplog.text and client.header("x-request-id") in caplog.text


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_404_from_the_upstream_is_a_generic_model_not_found_asked_once(
    stream: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    other = "w-other"
    records = [record(WORKER, model="m"), record(other, model="m")]
    policy = make_policy(hedging={"enabled": False}, cache={"enabled": False})
    async with running(policy, {WORKER: Behaviour(status=404, body=NOISY_ENVELOPE),
                                other: Behaviour(status=404, body=NOISY_ENVELOPE)},
                       records) as rig:
        app = GatewayApp(policy, LatestValue(RegistrySnapshot(version=0)), rig.scheduler,
                         rig.dispatcher)
        async with anyio.create_task_group() as tg:
            client = await Gateway(app, rig.workers, tg).stream(request=body(stream=stream))
            with anyio.fail_after(5):
                await client.finished.wait()
        calls = len(rig.workers.calls)
    assert client.status == 404, client.raw()
    error = envelope(client)
    assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")
    assert error["message"] == "the model server does not serve the requested model"
    assert calls == 1  # not retried on the other worker, which would say the same
    assert_no_leak(client)
    request_id = client.header("x-request-id")
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert any(SECRET in line and "answered 404" in line for line in logged), caplog.text


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_a_5xx_or_429_from_the_upstream_is_still_retried_on_another_worker(
    status: int,
) -> None:
    other = "w-other"
    records = [record(WORKER, model="m"), record(other, model="m")]
    policy = make_policy(hedging={"enabled": False}, cache={"enabled": False})
    async with running(policy, {WORKER: Behaviour(status=status, body=NOISY),
                                other: Behaviour(status=status, body=NOISY)},
                       records) as rig:
        app = GatewayApp(policy, LatestValue(RegistrySnapshot(version=0)), rig.scheduler,
                         rig.dispatcher)
        async with anyio.create_task_group() as tg:
            client = await Gateway(app, rig.workers, tg).stream(request=body(stream=False))
            with anyio.fail_after(5):
                await client.finished.wait()
        workers_asked = sorted(c.worker_id for c in rig.workers.calls)
    assert workers_asked == sorted([WORKER, other])
    assert client.status == 503 and envelope(client)["code"] == "no_healthy_worker"
    assert_no_leak(client)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_missing_upstream_key_names_no_env_var(
    stream: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    registration = WorkerRegistration(worker_id=WORKER, url=url_of(WORKER), kind="cpu",
                                      models=("m",), slots=4, external=True,
                                      api_key_env=KEY_ENV)
    records = [WorkerRecord(registration=registration, load=WorkerLoad(),
                            lease_expires_in_s=30.0)]
    client = await ask(Behaviour(), stream=stream, records=records)
    assert client.status == 503
    assert "not configured" in envelope(client)["message"]
    assert_no_leak(client)
    assert KEY_ENV in caplog.text  # the operator learns which variable is missing


# -- after the first token: a stream ends with our error event; a whole answer is a 502 --


MID_STREAM: list[tuple[str, Behaviour, str]] = [
    ("an SSE error event", Behaviour(garbage_after_tokens=1, garbage=ERROR_EVENT),
     "upstream_error"),
    ("an event that is not JSON", Behaviour(garbage_after_tokens=1,
                                            garbage=b"data: " + NOISY + b"\n\n"),
     "upstream_malformed"),
]


@pytest.mark.parametrize(("name", "behaviour", "code"), MID_STREAM)
async def test_a_stream_failing_mid_way_ends_with_our_error_event(
    name: str, behaviour: Behaviour, code: str, caplog: pytest.LogCaptureFixture,
) -> None:
    client = await ask(behaviour, stream=True)
    assert client.status == 200 and client.text() == "Hello"
    assert client.header("x-hedgerow-worker") == WORKER  # the contract keeps this header
    last = orjson.loads(client.events()[-1].data)
    assert last["error"]["code"] == code and last["error"]["type"] == "upstream_error"
    assert_no_leak(client)
    assert SECRET in caplog.text and client.header("x-request-id") in caplog.text


@pytest.mark.parametrize(("name", "behaviour", "code"), MID_STREAM)
async def test_a_whole_answer_failing_mid_way_is_a_502_envelope(
    name: str, behaviour: Behaviour, code: str,
) -> None:
    client = await ask(behaviour, stream=False)
    assert client.status == 502
    error = envelope(client)
    assert (error["type"], error["code"]) == ("upstream_error", code)
    assert_no_leak(client)

