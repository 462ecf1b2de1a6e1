"""What a worker may register, and what a gateway makes of a registered URL.

A worker registers itself with a ``SelfRegistration``: never the operator's
fields (external, model_map, api_key_env), and a URL that is an origin and
nothing more. Whatever the registry holds, the gateway rebuilds each request
URL from its parts, so no URL sends it to another host or another path.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from control_plane.bodies import _invalid
from gateway.corridor.attempt import request_url
from gateway.upstream.http1 import ConnectFailed
from gateway.upstream.worker_http import HttpPool
from hedgerow.endpoints import BadEndpoint, parse_endpoint
from hedgerow.errors import InvalidRequest, UpstreamFailed
from hedgerow.wire import SelfRegistration, WorkerRegistration
from workers.main import _url_of

PATH = "/v1/chat/completions"
GOOD = {"worker_id": "cpu-host-1a2b3c", "url": "http://10.0.0.7:8081", "kind": "cpu",
        "models": ["smollm2"], "slots": 2, "labels": {"pop": "ams"}}


def refusal(body: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(ValidationError) as caught:
        SelfRegistration.model_validate(body)
    return _invalid("worker registration", caught.value)


# -- the operator's fields -------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("external", True),
    ("api_key_env", "AWS_SECRET_ACCESS_KEY"),
    ("model_map", {"smollm2": "gpt-4o"}),
])
def test_a_worker_cannot_set_an_operators_field(field: str, value: Any) -> None:
    error = refusal({**GOOD, field: value})
    assert error.status == 400 and error.param == field and error.code == "field_not_allowed"
    assert error.message.startswith(f"invalid worker registration: {field} cannot be set")


def test_the_operators_fields_at_their_defaults_grant_nothing_and_pass() -> None:
    """What a worker of the previous release sends (it dumped the whole record)."""
    old = {**GOOD, "external": False, "model_map": {}, "api_key_env": None}
    record = SelfRegistration.model_validate(old).record()
    assert (record.external, record.model_map, record.api_key_env) == (False, {}, None)


def test_a_self_registration_becomes_a_plain_worker_record() -> None:
    record = SelfRegistration.model_validate({**GOOD, "url": "https://w.internal:8443/"}).record()
    assert isinstance(record, WorkerRegistration)
    assert record.url == "https://w.internal:8443" and not record.external
    assert record.labels == {"pop": "ams"} and record.models == ("smollm2",)


@pytest.mark.parametrize(("change", "field"), [
    ({"worker_id": "a/b"}, "worker_id"),  # it becomes a URL path segment
    ({"worker_id": "w\r\nx-evil: 1"}, "worker_id"),  # and a response header
    ({"labels": {f"k{i}": "v" for i in range(33)}}, "labels"),
    ({"models": ["m" * 129]}, "models.0"),
    ({"slots": 1025}, "slots"),
    ({"surprise": 1}, "surprise"),
])
def test_other_fields_are_bounded_and_named_when_wrong(change: dict[str, Any], field: str) -> None:
    error = refusal({**GOOD, **change})
    assert error.param == field and f": {field}: " in error.message


# -- the URL ---------------------------------------------------------------------


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://10.0.0.7:21", "http:// or https://"),
    ("file:///etc/passwd", "http:// or https://"),
    ("http://10.0.0.7", "explicit port"),
    ("http://user:pw@10.0.0.7:8081", "user or password"),
    ("http://metadata@169.254.169.254:80", "user or password"),
    ("http://10.0.0.7:8081/admin", "path"),
    ("http://10.0.0.7:8081/v1/embeddings", "path"),
    ("http://10.0.0.7:8081?x=", "query or a fragment"),
    ("http://10.0.0.7:8081/?", "query or a fragment"),
    ("http://10.0.0.7:8081#", "query or a fragment"),
    ("http://10.0.0.7:8081 /x", "spaces or control"),
    ("http://10.0.0.7:8081\r\nx-evil: 1", "spaces or control"),
    ("http://10.0.0.7:8081\t", "spaces or control"),
    ("http://wörker:8081", "ASCII"),
    ("http://:8081", "host"),
    ("http://a_b:8081", "host"),
    ("http://10.0.0.7:0", "port"),
    ("http://10.0.0.7:65536", "port"),
    ("http://10.0.0.7:80x", "port"),
    ("http://::1:8081", "host"),
    ("http://[::1:8081", "IPv6"),
    ("http://[10.0.0.7]:8081", "brackets"),
    ("http://" + "a" * 250 + ".io:1", "at most 256"),
])
def test_a_registered_url_must_be_an_origin(url: str, why: str) -> None:
    error = refusal({**GOOD, "url": url})
    assert error.status == 400 and error.param == "url"
    assert why in error.message, error.message


@pytest.mark.parametrize(("url", "stored"), [
    ("http://10.0.0.7:8081", "http://10.0.0.7:8081"),
    ("http://10.0.0.7:8081/", "http://10.0.0.7:8081"),
    ("https://gpu-3.pop-ams.internal:443", "https://gpu-3.pop-ams.internal:443"),
    ("http://[::1]:8081", "http://[::1]:8081"),
    ("http://[fd00::7]:9000/", "http://[fd00::7]:9000"),
])
def test_a_good_url_is_stored_as_its_origin(url: str, stored: str) -> None:
    assert SelfRegistration.model_validate({**GOOD, "url": url}).url == stored


def test_an_operators_upstream_may_have_a_prefix_and_a_default_port() -> None:
    endpoint = parse_endpoint("https://api.example.com/openai/", strict=False)
    assert endpoint.url_for(PATH) == "https://api.example.com:443/openai/v1/chat/completions"
    for bad in ("https://api.example.com/a/../admin", "https://k@api.example.com/x",
                "https://api.example.com/x?y=1", "https://api.example.com/a b"):
        with pytest.raises(BadEndpoint):
            parse_endpoint(bad, strict=False)


# -- the gateway's side: what it calls for a registry record ------------------------


def record(url: str, *, external: bool = False) -> WorkerRegistration:
    """A record as a gateway may receive it: the record type itself is lenient."""
    return WorkerRegistration(worker_id="w", url=url, kind="cpu", models=("m",), slots=1,
                              external=external)


@pytest.mark.parametrize("url", [
    "http://10.0.0.7:8081/admin?x=",  # would call /admin?x=/v1/chat/completions
    "http://10.0.0.7:8081#",  # would call / (the path lands in the fragment)
    "http://evil.example:80@10.0.0.7:8081",
    "http://10.0.0.7:8081/ HTTP/1.1\r\nhost: other",
    "http://10.0.0.7",  # not from a worker: it registers an explicit port
])
def test_the_gateway_refuses_a_worker_record_that_is_not_an_origin(url: str) -> None:
    with pytest.raises(UpstreamFailed) as caught:
        request_url(record(url), PATH)
    assert caught.value.code == "upstream_misconfigured"
    assert "10.0.0.7" not in str(caught.value.envelope())  # and says so in the log only
    assert "10.0.0.7" in caught.value.detail


def test_the_gateway_calls_the_registered_origin_and_its_own_path() -> None:
    assert request_url(record("http://10.0.0.7:8081/"), PATH) == \
        "http://10.0.0.7:8081/v1/chat/completions"
    assert request_url(record("https://up.example/v2", external=True), "/v1/completions") == \
        "https://up.example:443/v2/v1/completions"


@given(st.text(alphabet=st.characters(codec="ascii"), max_size=40),
       st.sampled_from(["http://", "https://", "http://h:1", "http://[::1]:2", "x"]))
def test_any_accepted_url_leads_to_its_own_host_and_the_gateways_path(tail: str,
                                                                        head: str) -> None:
    try:
        endpoint = parse_endpoint(head + tail, strict=True)
    except BadEndpoint:
        return
    url = endpoint.url_for(PATH)
    parts = urlsplit(url)
    assert (parts.path, parts.query, parts.fragment, parts.username) == (PATH, "", "", None)
    assert parts.port == endpoint.port and f"{parts.scheme}://{parts.netloc}" == endpoint.origin
    origin, prefix = HttpPool()._target(url)
    assert origin[1:3] == (parts.hostname, endpoint.port) and origin[3] == ""  # no identity asked
    assert prefix == f" {PATH} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode()


@pytest.mark.parametrize("url", ["http://a@h:1/v1", "http://h:1/v1#x", "http://h:1/a b",
                                 "http://h:1/a\x00", "http://h:x/v1"])
def test_the_pool_itself_refuses_a_url_that_could_pick_its_request_line(url: str) -> None:
    with pytest.raises(ConnectFailed):
        HttpPool()._target(url)


@pytest.mark.parametrize(("scheme", "host", "url"), [
    ("http", "10.0.0.7", "http://10.0.0.7:9000"), ("https", "fd00::7", "https://[fd00::7]:9000")])
def test_a_worker_advertises_a_url_its_registration_accepts(scheme: str, host: str,
                                                             url: str) -> None:
    advertised = _url_of(scheme, host, 9000)
    assert SelfRegistration.model_validate({**GOOD, "url": advertised}).url == url
