"""External upstreams: the schema's rules, the prober's book, the gateway's
request rewriting, and the admin token helpers (all without sockets)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from hedgerow.admin_token import LOOPBACK, admin_bind_host, read_admin_token
from control_plane.upstream_api import parse_upstream
from control_plane.upstreams import UpstreamBook, registration_for
from gateway.corridor.attempt import UpstreamCall, external_request
from hedgerow.errors import InvalidRequest, UnknownWorker, UpstreamFailed
from hedgerow.wire import WorkerLoad, WorkerRecord
from policies.loader import parse_policy_document
from policies.schema import PolicyError, Upstream


def issues(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        parse_policy_document(text, "p.yaml")
    return [str(issue) for issue in caught.value.issues]


def upstream(name: str = "llama", **changes: object) -> Upstream:
    fields: dict[str, object] = {"name": name, "url": "http://10.0.0.5:8080", "models": ["m"]}
    return Upstream.model_validate(fields | changes)


@pytest.mark.parametrize(("entry", "at", "expected"), [
    ("{name: a, url: 'ftp://h', models: [m]}", "'ftp",
     "upstreams[0].url: must be an http:// or https:// URL"),
    ("{name: a, url: 'http://k:s3cret@h/v1', models: [m]}", "'http",
     "upstreams[0].url: must not carry a user or password"),
    ("{name: a, url: 'http://h:8080/?x=1', models: [m]}", "'http",
     "upstreams[0].url: must not have a query or a fragment"),
    ("{name: a, url: 'http://h', models: []}", "[]",
     "upstreams[0].models: an upstream serves at least one model (models or embedding_models)"),
    ("{name: a, url: 'http://h', models: [m], api_key_env: 'sk-live-123'}", "'sk-",
     "upstreams[0].api_key_env: must be the NAME of an environment variable"),
    ("{name: a, url: 'http://h', models: [m], health_path: health}", "health}",
     "upstreams[0].health_path: must start with /"),
    ("{name: a, url: 'http://h', models: [m], kind: tpu}", "tpu",
     "upstreams[0].kind: Input should be 'cpu' or 'gpu'"),
    ("{name: a, url: 'http://h', models: [m], probe_interval_ms: 10}", "10}",
     "upstreams[0].probe_interval_ms: Input should be greater than or equal to 100"),
    ("{name: a, url: 'http://h', models: [m], model_map: {x: y}}", "y}",
     "upstreams[0].model_map.x: model_map renames 'x', which is not in models"),
    ("{name: a, url: 'http://h', models: [m], slotz: 2}", "slotz",
     "upstreams[0].slotz: unknown key 'slotz' (did you mean 'slots'?)"),
])
def test_each_upstream_rule_rejects_with_its_location(entry: str, at: str, expected: str) -> None:
    column = len("  - ") + entry.index(at) + 1
    found = issues(f"upstreams:\n  - {entry}\n")
    assert any(line.startswith(f"p.yaml:2:{column}: {expected}") for line in found), found


def test_two_upstreams_may_not_share_a_name() -> None:
    found = issues("upstreams:\n  - {name: a, url: 'http://h', models: [m]}\n"
                   "  - {name: a, url: 'http://g', models: [m]}\n")
    assert found == ["p.yaml:3:12: upstreams[1].name: duplicate upstream name 'a' "
                     "(also upstreams[0])"]


def test_an_upstream_becomes_an_external_worker_without_its_key() -> None:
    spec = upstream(kind="gpu", model_map={"m": "Qwen/Qwen2"}, api_key_env="VLLM_KEY",
                    url="http://h:8000/")
    registration = registration_for(spec)
    assert registration.external and registration.kind == "gpu"
    assert registration.url == "http://h:8000"
    assert registration.upstream_model("m") == "Qwen/Qwen2"
    assert registration.api_key_env == "VLLM_KEY"


def test_api_registrations_are_validated_like_the_policy() -> None:
    assert parse_upstream(b'{"name": "a", "url": "https://h", "models": ["m"]}').url == "https://h"
    with pytest.raises(InvalidRequest, match="slots"):
        parse_upstream(b'{"name": "a", "url": "https://h", "models": ["m"], "slots": 0}')
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_upstream(b"{")


# -- the book --------------------------------------------------------------------


def test_health_changes_are_reported_once_and_probes_follow_the_interval() -> None:
    book = UpstreamBook()
    book.set_policy((upstream(probe_interval_ms=1000),), version=1)
    assert [s.name for s in book.due(0.0)] == ["llama"]
    assert book.record("llama", True, None, now=0.0) == "healthy"
    assert book.due(0.5) == []
    assert book.record("llama", True, None, now=1.0) is None
    assert book.record("llama", False, "HTTP 503", now=2.0) == "unhealthy"
    assert book.record("llama", False, "HTTP 503", now=3.0) is None
    assert book.healthy() == []
    assert book.rows()[0]["last_error"] == "HTTP 503"


def test_policy_changes_drop_changed_and_removed_upstreams() -> None:
    book = UpstreamBook()
    a, b = upstream("a"), upstream("b")
    assert book.set_policy((a, b), 1) == []
    book.record("a", True, None, 0.0)
    assert book.set_policy((a, b), 2) == []
    assert book.healthy() == [a]  # an unchanged upstream keeps its health
    moved = upstream("a", url="http://elsewhere:1")
    assert book.set_policy((moved,), 3) == [a, b]
    assert [row["url"] for row in book.rows()] == ["http://elsewhere:1"]


def test_api_upstreams_cannot_shadow_or_remove_policy_ones() -> None:
    book = UpstreamBook()
    book.set_policy((upstream("a"),), 1)
    with pytest.raises(InvalidRequest, match="declared in the policy"):
        book.add(upstream("a", url="http://other:1"))
    with pytest.raises(UnknownWorker, match="declared in the policy"):
        book.remove("a")
    with pytest.raises(UnknownWorker, match="not registered"):
        book.remove("nope")
    book.add(upstream("b"))
    assert {row["name"]: row["source"] for row in book.rows()} == {"a": "policy", "b": "api"}
    assert book.remove("b").name == "b"


def test_a_policy_declaration_takes_over_an_api_registration() -> None:
    book = UpstreamBook()
    api = upstream("a")
    book.add(api)
    assert book.set_policy((upstream("a", slots=4),), 1) == [api]
    assert book.rows()[0]["source"] == "policy"


# -- the gateway's request to an external upstream --------------------------------


def record_for(spec: Upstream) -> WorkerRecord:
    return WorkerRecord(registration=registration_for(spec), load=WorkerLoad(),
                        lease_expires_in_s=1.0)


CALL = UpstreamCall("req-1", "/v1/chat/completions",
                    orjson.dumps({"model": "m", "stream": True, "messages": []}), "m")


def test_the_body_names_the_upstreams_own_model() -> None:
    body, headers = external_request(record_for(upstream(model_map={"m": "llama-3"})), CALL)
    assert orjson.loads(body) == {"model": "llama-3", "stream": True, "messages": []}
    assert headers == {}
    assert external_request(record_for(upstream()), CALL) == (CALL.body, {})


def test_the_key_comes_from_the_gateways_own_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = upstream(api_key_env="LLAMA_KEY")
    monkeypatch.delenv("LLAMA_KEY", raising=False)
    with pytest.raises(UpstreamFailed) as missing:
        external_request(record_for(spec), CALL)
    assert "$LLAMA_KEY" in missing.value.detail  # the operator learns which variable
    assert "LLAMA_KEY" not in str(missing.value.envelope())  # the client does not
    monkeypatch.setenv("LLAMA_KEY", "sk-abc")
    assert external_request(record_for(spec), CALL)[1] == {"authorization": "Bearer sk-abc"}


# -- admin token -------------------------------------------------------------------


def test_the_admin_token_comes_from_a_file_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HEDGEROW_ADMIN_TOKEN", raising=False)
    assert read_admin_token(None) is None
    monkeypatch.setenv("HEDGEROW_ADMIN_TOKEN", " from-env\n")
    assert read_admin_token(None) == "from-env"
    (tmp_path / "t").write_text("from-file\n")
    assert read_admin_token(tmp_path / "t") == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty|1-"):
        read_admin_token(tmp_path / "empty")


def test_without_a_token_only_loopback_is_served() -> None:
    assert admin_bind_host("0.0.0.0", None) == LOOPBACK
    assert admin_bind_host("::1", None) == "::1"
    assert admin_bind_host("0.0.0.0", "t") == "0.0.0.0"
