"""``POST /v1/embeddings`` through the real gateway app: tenancy, limits, admission, metrics.

The embedder is an in-memory twin (vectors from the text's length); the
tokenizer is the model's real ``tokenizer.json``, so the window check and the
usage counts are the ones a client gets from the real gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import orjson
import pytest

from gateway.app import GatewayApp
from gateway.cache import ResponseCache
from gateway.corridor.key_gate import KeyGate
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.keys import key_digest, new_key
from policies.schema import hash_api_key
from tests.integration.test_dispatch import MODEL, make_policy, running
from tests.integration.test_resumable_streams import until
from tests.support.asgi_client import Client, Gateway
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio

TENANTS = [{"name": "t", "class": "interactive",
            "limits": {"requests_per_s": 0.01, "requests_burst": 2}},  # no refill in a test
           {"name": "u", "class": "interactive", "api_key_sha256": [hash_api_key("key-u")]},
           {"name": "v", "class": "interactive", "api_key_sha256": [hash_api_key("key-v")],
            # 14 tokens and no refill in a test: two requests of 7.
            "limits": {"tokens_per_min": 0.01, "tokens_burst": 14}}]


KEY_SECRET = bytes(range(32))


def virtual_key(key_id: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """A key (what the client sends) and its policy entry (``hedgerow key create``'s)."""
    text = new_key()
    return text, {"id": key_id, "tenant": "u", "hmac_sha256": key_digest(KEY_SECRET, text),
                  "created_at": 0, **fields}


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


class LengthEmbedder:
    dim = 384

    def __init__(self, ready: bool = True) -> None:
        self.ready = ready
        self.texts: list[str] = []

    async def embed(self, text: str) -> np.ndarray:
        self.texts.append(text)
        vector = np.zeros(self.dim, dtype=np.float32)
        vector[len(text) % self.dim] = 1.0
        return vector


@asynccontextmanager
async def gateway(embedder: LengthEmbedder, **sections: Any) -> AsyncIterator[Gateway]:
    sections.setdefault("cache", {"enabled": True, "semantic": {"enabled": False}})
    policy = make_policy(tenants=TENANTS, hedging={"enabled": False}, **sections)
    async with running(policy, {"a": Behaviour()}) as rig:
        cache = ResponseCache(policy, embedder=embedder)
        app = GatewayApp(policy, LatestValue(RegistrySnapshot(version=0)), rig.scheduler,
                         rig.dispatcher, cache=cache, keys=KeyGate(secret=KEY_SECRET))
        async with anyio.create_task_group() as tg:
            yield Gateway(app, rig.workers, tg)
            tg.cancel_scope.cancel()


async def embed(gw: Gateway, headers: list[tuple[bytes, bytes]] | None = None,
                **fields: Any) -> Client:
    body = orjson.dumps({"model": "all-minilm-l6-v2", "input": ["a cat", "dog"], **fields})
    client = gw.start(Client("POST", "/v1/embeddings", body, headers=[
        (b"content-type", b"application/json"), *(headers or [])]))
    await until(client.finished.is_set, timeout=30)
    return client


async def test_each_text_gets_its_vector_in_order_with_the_models_token_counts() -> None:
    embedder = LengthEmbedder()
    async with gateway(embedder) as gw:
        client = await embed(gw)
        metrics = await gw.app.render_metrics()
    assert client.status == 200 and client.header("x-request-id")
    answer = client.json()
    assert [d["index"] for d in answer["data"]] == [0, 1] and answer["model"] == "all-minilm-l6-v2"
    assert [int(np.argmax(d["embedding"])) for d in answer["data"]] == [5, 3]
    # [CLS] a cat [SEP] and [CLS] dog [SEP]
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert embedder.texts == ["a cat", "dog"]
    assert ('hedgerow_requests_total{class="interactive",model="all-minilm-l6-v2",status="200"} '
            '1.0') in metrics.decode()


async def test_a_text_longer_than_the_window_is_a_400_before_any_embedding() -> None:
    embedder = LengthEmbedder()
    async with gateway(embedder) as gw:
        client = await embed(gw, input=["short", "word " * 300])
    assert client.status == 400 and embedder.texts == []
    assert (client.json()["error"]["code"], client.json()["error"]["param"]) == (
        "input_too_long", "input.1")


async def test_the_tenants_requests_rate_applies() -> None:
    async with gateway(LengthEmbedder()) as gw:
        statuses = [(await embed(gw)).status for _ in range(3)]
    assert statuses == [200, 200, 429]


async def test_the_tenants_tokens_per_min_applies_and_a_failed_request_gives_its_tokens_back(
) -> None:
    # Embeddings used to count toward requests/s only: a tenant could embed
    # past its token rate. Each request here is 7 tokens; the burst holds 14.
    embedder = LengthEmbedder(ready=False)
    async with gateway(embedder, cache={"enabled": True, "semantic": {"enabled": True}}) as gw:
        failed = await embed(gw, bearer("key-v"))  # 503 after the charge: it goes back
        embedder.ready = True
        served = [await embed(gw, bearer("key-v")) for _ in range(2)]
        refused = await embed(gw, bearer("key-v"))
        other = await embed(gw, bearer("key-u"))  # another tenant's bucket
    assert failed.status == 503
    assert [c.status for c in served] == [200, 200]
    assert refused.status == 429 and int(refused.header("retry-after") or 0) >= 1
    assert refused.json()["error"]["code"] == "tokens_rate"
    assert len(embedder.texts) == 4 + 2  # the refused request embedded nothing
    assert other.status == 200


@pytest.mark.parametrize("headers, model, status, code", [
    ([(b"authorization", b"Bearer wrong")], "all-minilm-l6-v2", 401, "invalid_api_key"),
    ([(b"authorization", b"Bearer key-u")], "all-MiniLM-L6-v2", 200, None),
    ([], "text-embedding-3-small", 404, "model_not_found"),
])
async def test_keys_and_models(headers: list[tuple[bytes, bytes]], model: str, status: int,
                               code: str | None) -> None:
    async with gateway(LengthEmbedder()) as gw:
        client = await embed(gw, headers, model=model)
    assert client.status == status
    if code is not None:
        assert client.json()["error"]["code"] == code


async def test_an_embedder_that_is_not_running_yet_is_a_503_to_retry() -> None:
    # The policy runs it (semantic cache on): it is loading or restarting.
    async with gateway(LengthEmbedder(ready=False),
                       cache={"enabled": True, "semantic": {"enabled": True}}) as gw:
        client = await embed(gw)
    assert client.status == 503 and client.header("retry-after") == "1"
    assert client.json()["error"]["code"] == "embeddings_unavailable"


async def test_the_model_is_not_found_while_the_policy_does_not_run_it() -> None:
    # The shipped default: semantic cache off, no sidecar. /v1/models does not list
    # the model, so a 503 "retry" would be a lie the client's retry loop believes.
    async with gateway(LengthEmbedder(ready=False)) as gw:
        client = await embed(gw)
        listed = gw.start(Client("GET", "/v1/models", b""))
        await until(listed.finished.is_set, timeout=30)
    assert client.status == 404
    assert b"retry-after" not in dict(client.sent[0]["headers"])
    error = client.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "semantic cache off" in error["message"]
    assert "all-MiniLM-L6-v2" not in [m["id"] for m in listed.json()["data"]]


async def test_embeddings_spend_the_keys_budget_and_a_spent_one_is_refused_as_on_chat() -> None:
    # Each request is 7 tokens ([CLS] a cat [SEP] + [CLS] dog [SEP]): two fit in 14, not three.
    text, entry = virtual_key("key_00000000000000b1", budgets=[{"period": "day", "tokens": 14}])
    other, unlimited = virtual_key("key_00000000000000b2")
    embedder = LengthEmbedder()
    async with gateway(embedder, keys=[entry, unlimited]) as gw:
        served = [await embed(gw, bearer(text)) for _ in range(2)]
        refused = await embed(gw, bearer(text))
        metrics = (await gw.app.render_metrics()).decode()
        embedded = len(embedder.texts)
        elsewhere = await embed(gw, bearer(other))  # the tenant's other key has no budget
    assert [c.status for c in served] == [200, 200]
    assert [c.json()["usage"]["prompt_tokens"] for c in served] == [7, 7]
    assert refused.status == 429 and int(refused.header("retry-after") or 0) >= 1
    error = refused.json()["error"]
    assert error["code"] == "budget_exceeded"
    assert "14 tokens per day; 14 tokens used" in error["message"], error["message"]
    assert embedded == 4  # the refused request embedded nothing
    assert elsewhere.status == 200
    assert ('hedgerow_tenant_tokens_total{model="all-minilm-l6-v2",tenant="u",type="prompt"}'
            ' 14.0') in metrics, metrics


async def test_a_key_that_may_not_use_the_embedding_model_is_403() -> None:
    text, entry = virtual_key("key_00000000000000b3", models=[MODEL])
    async with gateway(LengthEmbedder(), keys=[entry]) as gw:
        refused = await embed(gw, bearer(text))
    assert refused.status == 403 and refused.json()["error"]["code"] == "model_not_allowed"


async def get(gw: Gateway, path: str, headers: list[tuple[bytes, bytes]] | None = None
              ) -> Client:
    client = gw.start(Client("GET", path, headers=headers or []))
    await until(client.finished.is_set, timeout=30)
    return client


async def test_models_lists_only_what_the_presented_key_may_use() -> None:
    chat_only, restricted = virtual_key("key_00000000000000c1", models=[MODEL])
    anything, open_key = virtual_key("key_00000000000000c2")
    async with gateway(LengthEmbedder(), keys=[restricted, open_key]) as gw:
        everyone = await get(gw, "/v1/models")
        scoped = await get(gw, "/v1/models", bearer(chat_only))
        anthropic = await get(gw, "/v1/models", [(b"x-api-key", chat_only.encode())])
        unscoped = await get(gw, "/v1/models", bearer(anything))
        legacy = await get(gw, "/v1/models", bearer("key-u"))
        wrong = await get(gw, "/v1/models", bearer("sk-hr-wrong"))
        one = await get(gw, f"/v1/models/{MODEL}", bearer(chat_only))
        hidden = await get(gw, "/v1/models/all-minilm-l6-v2", bearer(chat_only))
        shown = await get(gw, "/v1/models/all-minilm-l6-v2")
        absent = await get(gw, "/v1/models/no-such-model")
    both = [MODEL, "all-minilm-l6-v2"]
    assert [m["id"] for m in everyone.json()["data"]] == both
    assert [m["id"] for m in scoped.json()["data"]] == [MODEL]
    assert [m["id"] for m in anthropic.json()["data"]] == [MODEL]
    assert [m["id"] for m in unscoped.json()["data"]] == both
    assert [m["id"] for m in legacy.json()["data"]] == both
    assert wrong.status == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert one.status == 200 and one.json() == {"id": MODEL, "object": "model", "created": 0,
                                                "owned_by": "hedgerow"}
    assert shown.status == 200 and shown.json()["kind"] == "embedding"
    for missing in (hidden, absent):  # a forbidden model reads as an absent one
        assert missing.status == 404 and missing.json()["error"]["code"] == "model_not_found"
