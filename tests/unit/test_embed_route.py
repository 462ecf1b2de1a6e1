"""Forwarding ``POST /v1/embeddings`` (``gateway.corridor.embed_route``) and the
``embedding_models`` a worker or upstream declares, with an in-memory transport."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from gateway.corridor import embed_route
from gateway.upstream.http1 import ConnectFailed
from gateway.upstream.client import WorkerClient
from tests.support.worker_mock import MockReply, MockTransport, WorkerRequest
from hedgerow.errors import UpstreamFailed, UpstreamRejected
from hedgerow.wire import (
    RegistrySnapshot,
    SelfRegistration,
    WorkerLoad,
    WorkerRecord,
    WorkerRegistration,
)
from policies.schema import Upstream

pytestmark = pytest.mark.anyio

ANSWER = {"object": "list", "model": "BAAI/bge-small",
          "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
          "usage": {"prompt_tokens": 3, "total_tokens": 3}}


def record(worker_id: str, active: int = 0, *, draining: bool = False,
           **fields: Any) -> WorkerRecord:
    registration = WorkerRegistration(**{
        "worker_id": worker_id, "url": f"http://{worker_id}:8080", "kind": "cpu",
        "models": (), "embedding_models": ("bge",), "slots": 2, "external": True, **fields})
    return WorkerRecord(registration=registration,
                        load=WorkerLoad(active=active, draining=draining),
                        lease_expires_in_s=5)


def test_an_embedding_only_worker_or_upstream_is_valid_and_earlier_ones_still_are() -> None:
    earlier = {"worker_id": "w", "url": "http://10.0.0.1:8081", "kind": "cpu",
               "models": ["smollm2"], "slots": 1}
    assert SelfRegistration.model_validate(earlier).record().embedding_models == ()
    only = SelfRegistration.model_validate({**earlier, "models": [],
                                            "embedding_models": ["bge"]})
    assert only.record().embedding_models == ("bge",)
    with pytest.raises(ValidationError, match="at least one model"):
        SelfRegistration.model_validate({**earlier, "models": []})
    spec = Upstream(name="tei", url="http://h:8080", embedding_models=("bge",),
                    model_map={"bge": "BAAI/bge-small"})
    assert spec.models == ()


def test_candidates_offer_the_model_least_loaded_first_and_skip_the_draining() -> None:
    snapshot = RegistrySnapshot(version=1, workers=(
        record("busy", active=2), record("idle-b"), record("idle-a"),
        record("leaving", draining=True), record("chat-only", embedding_models=(),
                                                 models=("chat",))))
    assert [w.registration.worker_id for w in embed_route.candidates(snapshot, "bge")] == [
        "idle-a", "idle-b", "busy"]
    assert embed_route.candidates(snapshot, "other") == []
    # Chat never sees an embedding model, nor embeddings a chat model.
    assert snapshot.models() == ("chat",) and snapshot.serving("bge") == ()
    assert snapshot.embedding_models() == ("bge",)


async def forward(handler: Any, workers: list[WorkerRecord]) -> embed_route.Forwarded:
    client = WorkerClient(transport=MockTransport(handler))
    call = embed_route.upstream_call("r1", {"model": "bge", "input": ["hi"]}, "bge")
    return await embed_route.forward(client, workers, call, "bge", attempt_timeout_s=5)


async def test_a_failure_before_the_answer_is_retried_on_the_next_with_names_mapped() -> None:
    seen: list[WorkerRequest] = []

    def handler(request: WorkerRequest) -> MockReply:
        seen.append(request)
        if request.host == "down":
            raise ConnectFailed("refused")
        if request.host == "err":
            return MockReply(500, body=b"internal detail")
        return MockReply(200, body=orjson.dumps(ANSWER))

    mapped = {"model_map": {"bge": "BAAI/bge-small"}}
    answer = await forward(handler, [record("down"), record("err"), record("ok", **mapped)])
    assert [r.host for r in seen] == ["down", "err", "ok"]
    assert orjson.loads(seen[-1].body)["model"] == "BAAI/bge-small"
    assert seen[-1].url == "http://ok:8080/v1/embeddings"
    assert answer.worker_id == "ok" and answer.prompt_tokens == 3
    assert answer.body == {**ANSWER, "model": "bge"}


@pytest.mark.parametrize(("status", "client_status"), [(400, 400), (404, 404)])
async def test_the_clients_mistake_is_not_retried_and_no_upstream_words_reach_it(
    status: int, client_status: int, caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []

    def handler(request: WorkerRequest) -> MockReply:
        seen.append(request.host)
        words = b'{"error": {"message": "no such model at sk-upstream"}}'
        return MockReply(status, body=words) if request.host == "a" else MockReply(
            200, body=orjson.dumps(ANSWER))

    with pytest.raises(UpstreamRejected) as rejected:
        await forward(handler, [record("a"), record("b")])
    assert seen == ["a"]
    assert rejected.value.status == client_status
    assert "sk-upstream" not in str(rejected.value.envelope())
    assert "request r1: embeddings refused by a" in caplog.text  # the detail, for operators
    assert "sk-upstream" in caplog.text

    def malformed(request: WorkerRequest) -> MockReply:
        return MockReply(200, body=b'{"secret": "sk-upstream"}')

    with pytest.raises(UpstreamFailed) as failed:
        await forward(malformed, [record("a"), record("b")])
    assert failed.value.code == "upstream_malformed"
    assert "sk-upstream" not in failed.value.message


@pytest.mark.parametrize("usage", [None, {"total_tokens": 3}, {"prompt_tokens": "3"},
                                   {"prompt_tokens": -1}, {"prompt_tokens": True}])
async def test_an_answer_without_a_usable_token_count_says_so(usage: Any) -> None:
    # None, not 0: the gateway then settles what it reserved, since settling 0
    # would give back every token an upstream that omits usage embedded.
    answer = {key: value for key, value in ANSWER.items() if key != "usage"}
    if usage is not None:
        answer["usage"] = usage
    forwarded = await forward(lambda _: MockReply(200, body=orjson.dumps(answer)), [record("a")])
    assert forwarded.prompt_tokens is None
