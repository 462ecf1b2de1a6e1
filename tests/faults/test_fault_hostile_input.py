"""Hostile request bodies over the wire: always a 4xx with the OpenAI envelope.

A running gateway gets bodies built to hurt a parser (deep nesting, huge
numbers, invalid UTF-8, NUL bytes, a body far over the limit in chunks) and a
few hundred random ones from hypothesis, over one HTTP/1.1 connection and
over HTTP/2. Every answer is a 4xx whose body is ``{"error": {...}}`` with a
message, type and code; none is a 5xx, none hangs, and the gateway then
serves an ordinary request.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.stack import Stack
from tests.support.streams import MODEL, chat_body, client

pytestmark = pytest.mark.e2e

SIM = ["--backend", "sim", "--slots", "4", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "4"]
OK = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]' % MODEL.encode()


def _chunks(total: int, size: int = 65536) -> Iterator[bytes]:
    yield b'{"model": "m", "messages": [{"role": "user", "content": "'
    sent = 0
    while sent < total:
        yield b"x" * size
        sent += size
    yield b'"}]}'


HOSTILE: list[tuple[str, bytes | None, dict[str, str | bytes]]] = [
    ("deep arrays", b"[" * 100_000 + b"]" * 100_000, {}),
    ("deep inside a message", OK + b', "x": ' + b"[" * 200 + b"]" * 200 + b"}", {}),
    ("deep objects", b'{"a":' * 5000 + b"1" + b"}" * 5000, {}),
    ("huge integer", OK + b', "max_tokens": 1' + b"0" * 400 + b"}", {}),
    ("float overflow", OK + b', "temperature": 1e999}', {}),
    ("negative max_tokens", OK + b', "max_tokens": -1}', {}),
    ("invalid utf-8", OK[:-2] + b'\xff\xfe"}]}', {}),
    ("nul bytes", b"\x00" * 1000, {}),
    ("empty body", b"", {}),
    ("json array", b"[]", {}),
    ("many messages", orjson.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x"}] * 5000}), {}),
    ("role not allowed", orjson.dumps({"model": MODEL, "messages": [
        {"role": "root", "content": "x"}]}), {}),
    ("wrong content type", OK + b"}", {"content-type": "application/x-www-form-urlencoded"}),
    ("chunked over the body limit", None, {}),
    ("bad deadline header", OK + b"}", {"x-hedgerow-deadline-ms": "-5"}),
    # Latin-1 0xb2 is '²': str.isdigit() says yes, int() says no.
    ("deadline of a superscript digit", OK + b"}", {"x-hedgerow-deadline-ms": b"\xb2"}),
    ("deadline of 5,000 digits", OK + b"}", {"x-hedgerow-deadline-ms": "9" * 5000}),
    ("deadline with an underscore", OK + b"}", {"x-hedgerow-deadline-ms": "1_000"}),
    ("stream as a string", OK + b', "stream": "yes"}', {}),
    ("stream as the string true", OK + b', "stream": "true"}', {}),
    ("stream as a number", OK + b', "stream": 1}', {}),
    ("max_tokens as a string", OK + b', "max_tokens": "5"}', {}),
    ("temperature as a string", OK + b', "temperature": "0.5"}', {}),
    ("malformed authorization", OK + b"}", {"authorization": "Basic Zm9vOmJhcg=="}),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("hostile"))
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


def _assert_client_error(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"], error


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_hostile_bodies_get_a_4xx_envelope_and_the_gateway_carries_on(
        stack: Stack, http2: bool) -> None:
    with client(stack, http2=http2, timeout=10) as http:
        for name, body, headers in HOSTILE:
            if body is None and http2:
                continue  # httpx cannot read an early HTTP/2 response: curl, below
            content = _chunks(4 * 1_048_576) if body is None else body
            response = http.post("/v1/chat/completions", content=content,
                                 headers={"content-type": "application/json", **headers})
            _assert_client_error(response)
        assert http.post("/v1/chat/completions", json=chat_body(4)).status_code == 200


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
@pytest.mark.parametrize("last_event_id", [b"\xb2", b"9" * 5000, b"-1", b"+1", b"1_0"],
                         ids=["superscript", "5000-digits", "minus", "plus", "underscore"])
def test_an_odd_last_event_id_is_a_400(stack: Stack, http2: bool, last_event_id: bytes) -> None:
    with client(stack, http2=http2, timeout=10) as http:
        answer = http.post("/v1/chat/completions", json={**chat_body(4), "stream": True})
        assert answer.status_code == 200
        events = f"/v1/chat/completions/{answer.headers['x-request-id']}/events"
        response = http.get(events, headers={"last-event-id": last_event_id})
        _assert_client_error(response)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "Last-Event-ID"
        # The same stream, asked properly, is still there.
        assert http.get(events, headers={"last-event-id": "1"}).status_code == 200


def test_a_stream_field_that_is_not_a_boolean_is_refused_naming_it(stack: Stack) -> None:
    with client(stack, timeout=10) as http:
        for value in ("yes", "true", 1, None):
            response = http.post("/v1/chat/completions", json={**chat_body(4), "stream": value})
            assert response.status_code == 400, (value, response.text[:200])
            assert response.json()["error"]["param"] == "stream"
        assert http.post("/v1/chat/completions",
                         json={**chat_body(4), "stream": False}).status_code == 200


def _gateway_client(stack: Stack) -> tuple[str, httpx.Client]:
    """The stack's gateway's own identity (name, client): a gateway may report
    policy only as itself."""
    (creds,) = (stack.root / "state").glob("identity-gateway-*")
    context = ssl.create_default_context(cafile=stack.cluster_ca)
    context.load_cert_chain(creds / "cert.pem", creds / "key.pem")
    name = creds.name.removeprefix("identity-gateway-")
    return name, httpx.Client(base_url=stack.control_plane_url, verify=context, timeout=5)


def test_the_control_plane_refuses_odd_numbers_and_booleans(stack: Stack) -> None:
    name, gateway = _gateway_client(stack)
    # A gateway's policy answer: bool("false") would be True, int("١") would be 1.
    with gateway:
        for answer in ({"version": "\u0661", "accepted": True}, {"version": "1", "accepted": True},
                       {"version": True, "accepted": True}, {"version": 1, "accepted": "false"},
                       {"version": -1, "accepted": True}, {"version": 1.0, "accepted": True}):
            response = gateway.post(f"/v1/gateways/{name}/policy", json=answer)
            _assert_client_error(response)
        assert gateway.post(f"/v1/gateways/{name}/policy",
                            json={"version": 1, "accepted": True}).status_code == 200
    with stack.admin(timeout=5) as admin:
        # A watcher's ?since= that is no version number is "none known", never a 500.
        for since in ("%C2%B2", "9" * 5000, "-1", "+1"):
            with admin.stream("GET", f"/v1/watch?since={since}") as watch:
                assert watch.status_code == 200
                assert next(watch.iter_lines()).startswith(("data:", "id:", "event:"))
        # A policy version that is not plain digits is a 400, not a 500.
        for version in ("%C2%B2", "9" * 5000, "+1"):
            _assert_client_error(admin.get(f"/v1/policy/{version}"))


def test_an_http2_upload_over_the_limit_does_not_cut_other_streams(stack: Stack) -> None:
    """The gateway refuses a body over the limit (413) while the client is still
    sending it; the rest of that body must not kill the connection and with it
    the other streams multiplexed on it (hypercorn 0.18 raised KeyError there:
    ``gateway/edge/h2_guard.py``). httpx cannot read a response that arrives before
    its upload ends, so only the other stream's fate is asserted."""
    with client(stack, http2=True, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(400)) as long:
            assert long.status_code == 200
            chunks = long.iter_text()
            first = next(chunks)
            try:
                http.post("/v1/chat/completions", content=_chunks(4 * 1_048_576),
                          headers={"content-type": "application/json"})
            except httpx.RemoteProtocolError:
                pass  # the client-side limitation above
            rest = first + "".join(chunks)
    assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
    gateway = next(p for p in stack.procs if p.name == "gateway")
    assert "KeyError" not in gateway.log()


@pytest.fixture(scope="module")
def h1(stack: Stack) -> Iterator[httpx.Client]:
    with client(stack, timeout=10) as http:
        yield http


json_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats()
                | st.text(max_size=30))
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=10), children, max_size=4),
                           max_leaves=25)
near_requests = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), json_values),
     "messages": st.one_of(st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
          "content": json_values}), max_size=3), json_values)},
    optional={"max_tokens": json_values, "temperature": json_values, "stream": json_values,
              "stop": json_values, "n": json_values, "top_p": json_values})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=300), json_values.map(orjson.dumps),
                 near_requests.map(lambda v: orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS))))
def test_random_bodies_never_get_a_5xx(h1: httpx.Client, body: bytes) -> None:
    response = h1.post("/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"})
    if response.status_code == 200:
        return  # hypothesis found a valid request: served
    _assert_client_error(response)
