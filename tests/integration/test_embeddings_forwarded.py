"""``POST /v1/embeddings`` forwarded to external upstreams that offer an embedding
model, through a live control plane and gateway, with the official ``openai`` SDK.

The upstreams are two tiny OpenAI-compatible servers in this process (plain
HTTP, outside Hedgerow's trust, as a real embeddings server would be). Both
declare ``embed-ext`` under ``embedding_models``, known upstream as
``upstream-embed``. ``a-broken`` answers every embeddings request with a 500;
the gateway tries the least loaded upstream first, ties by name, so every
request reaches ``a-broken`` first and is retried on ``b-good``. A simulated
Hedgerow worker (``--sim-embedding-model sim-embed``) registers itself with an
embedding model too, and is reached over the cluster's mutual TLS.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from policies.schema import hash_api_key
from tests.support.stack import Stack, free_port, wait_for
from workers.sim_embeddings import sim_vector

pytestmark = pytest.mark.e2e

CLIENT_MODEL = "embed-ext"
UPSTREAM_MODEL = "upstream-embed"
KEY = "sk-embed-tenant"
SIM_MODEL = "sim-embed"


def vector(text: str) -> list[float]:
    """Deterministic: the same text gives the same vector, another text another."""
    return [float(len(text)), float(sum(map(ord, text)) % 97), 0.5]


def encoded(values: list[float], encoding_format: str | None) -> list[float] | str:
    """As OpenAI's: base64 is little-endian float32 (the SDK asks for it by default)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


class FakeEmbeddings:
    """One upstream: records the bodies it was sent; ``broken`` answers 500."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken
        self.bodies: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the control plane's health probe
                self._reply(200, {"object": "list", "data": []})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.bodies.append(body)
                if fake.broken:
                    self._reply(500, {"error": {"message": "secret internal detail"}})
                    return
                texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
                self._reply(200, {
                    "object": "list", "model": body["model"],
                    "data": [{"object": "embedding", "index": i,
                              "embedding": encoded(vector(t), body.get("encoding_format"))}
                             for i, t in enumerate(texts)],
                    "usage": {"prompt_tokens": 7, "total_tokens": 7}})

            def _reply(self, status: int, answer: dict[str, Any]) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass  # the test's output, not an access log

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def policy_text(broken: FakeEmbeddings, good: FakeEmbeddings) -> str:
    upstreams = "".join(f"""
  - name: {name}
    url: http://127.0.0.1:{fake.port}
    embedding_models: [{CLIENT_MODEL}]
    model_map: {{{CLIENT_MODEL}: {UPSTREAM_MODEL}}}
    probe_interval_ms: 300
""" for name, fake in (("a-broken", broken), ("b-good", good)))
    return f"""
classes:
  - {{name: interactive, ttft_slo_ms: 2000, deadline_ms: 20000}}
tenants:
  - {{name: t, class: interactive, api_key_sha256: ["{hash_api_key(KEY)}"]}}
cache: {{enabled: false}}
upstreams:{upstreams}"""


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeEmbeddings, FakeEmbeddings]]:
    broken, good = FakeEmbeddings(broken=True), FakeEmbeddings(broken=False)
    yield broken, good
    broken.close()
    good.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory,
          fakes: tuple[FakeEmbeddings, FakeEmbeddings]) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("embed-upstreams")
    (root / "policy.yaml").write_text(policy_text(*fakes))
    stack = Stack(root)
    try:
        stack.start_control_plane(policy=root / "policy.yaml")
        stack.start_worker("c-sim", "--backend", "sim", "--model-name", "sim-chat",
                           "--sim-embedding-model", SIM_MODEL, "--sim-seed", "3")
        stack.start_gateway()
        tls = ssl.create_default_context(cafile=stack.ca_cert)
        wait_for(lambda: httpx.get(stack.gateway_url + "/readyz", verify=tls).json()[
            "workers"] == 3, "both upstreams and the worker listed")
        yield stack
    finally:
        stack.stop_all()


def client(stack: Stack, key: str = KEY) -> openai.OpenAI:
    tls = ssl.create_default_context(cafile=stack.ca_cert)
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=tls))


def test_forwarded_retried_past_a_failing_upstream_and_named_as_asked(
        stack: Stack, fakes: tuple[FakeEmbeddings, FakeEmbeddings]) -> None:
    broken, good = fakes
    with client(stack) as sdk:
        answer = sdk.embeddings.create(model=CLIENT_MODEL, input=["a cat", "dogs"])
    assert answer.model == CLIENT_MODEL
    assert [d.embedding for d in answer.data] == [vector("a cat"), vector("dogs")]
    assert answer.usage.prompt_tokens == 7
    # Each upstream was asked under its own name for the model; the broken one first.
    assert broken.bodies[-1] == good.bodies[-1]
    assert good.bodies[-1]["model"] == UPSTREAM_MODEL
    assert good.bodies[-1]["input"] == ["a cat", "dogs"]
    # Counted like chat: by model, class and status.
    assert re.search(rf'hedgerow_requests_total{{[^}}]*model="{CLIENT_MODEL}"[^}}]*'
                     r'status="200"[^}]*} [1-9]', stack.gateway_metrics()), "no 200 counted"


def test_a_registered_worker_answers_over_mutual_tls(stack: Stack) -> None:
    with client(stack) as sdk:
        raw = sdk.embeddings.with_raw_response.create(model=SIM_MODEL, input=["x y", "z"])
    answer = raw.parse()
    assert raw.headers["x-hedgerow-worker"] == "c-sim"
    assert answer.model == SIM_MODEL
    assert [d.embedding for d in answer.data] == [
        sim_vector("x y", 3).tolist(), sim_vector("z", 3).tolist()]
    assert answer.usage.prompt_tokens == 3
    # The registry and the operator's status show what it offers.
    with stack.admin() as operator:
        status = operator.get("/v1/status").json()
    listed = {w["worker_id"]: w for w in status["workers"]}
    assert listed["c-sim"]["embedding_models"] == [SIM_MODEL]
    assert listed["c-sim"]["models"] == ["sim-chat"]


def test_unknown_model_is_404_and_a_bad_key_401(stack: Stack) -> None:
    with client(stack) as sdk, pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="no-such-embedder", input="hi")
    assert missing.value.code == "model_not_found"
    with client(stack, key="sk-wrong") as sdk, pytest.raises(openai.AuthenticationError):
        sdk.embeddings.create(model=CLIENT_MODEL, input="hi")


def test_models_lists_the_upstreams_embedding_model_as_one(stack: Stack) -> None:
    with client(stack) as sdk:
        listed = [m.model_dump() for m in sdk.models.list()]
    # Once, as an embedding model: never offered to chat clients as a chat model.
    for name in (CLIENT_MODEL, SIM_MODEL):
        assert [m.get("kind") for m in listed if m["id"] == name] == ["embedding"]
    assert [m.get("kind") for m in listed if m["id"] == "sim-chat"] == [None]


def new_key(stack: Stack, **body: Any) -> str:
    """A virtual key (``hedgerow key create``), once the gateway runs the version with it."""
    with stack.admin() as operator:
        reply = operator.post("/v1/keys", json={"tenant": "t", **body})
        assert reply.status_code == 201, reply.text
        version = int(reply.json()["version"])
        wait_for(lambda: all((g["running_version"] or 0) >= version for g in
                             operator.get("/v1/status").json()["gateways"]),
                 "the gateway to run the version with the new key")
    return str(reply.json()["key"])


def test_forwarded_embeddings_spend_a_keys_budget_by_the_answers_usage(stack: Stack) -> None:
    # About 2 tokens reserved per request (four characters a token), 7 charged once the
    # upstream says so: the third request would pass 10 tokens, after two answers.
    key = new_key(stack, budgets=[{"period": "day", "tokens": 10}])
    with client(stack, key) as sdk:
        for _ in range(2):
            assert sdk.embeddings.create(model=CLIENT_MODEL, input=["a cat", "dogs"]).usage \
                .prompt_tokens == 7
        with pytest.raises(openai.RateLimitError) as spent:
            sdk.embeddings.create(model=CLIENT_MODEL, input=["a cat", "dogs"])
    assert spent.value.code == "budget_exceeded"
    assert "10 tokens per day; 14 tokens used" in spent.value.message


def test_a_keys_model_list_and_lookup_show_only_its_models(stack: Stack) -> None:
    key = new_key(stack, models=[CLIENT_MODEL])
    with client(stack, key) as sdk:
        assert [m.id for m in sdk.models.list()] == [CLIENT_MODEL]
        assert sdk.models.retrieve(CLIENT_MODEL).id == CLIENT_MODEL
        with pytest.raises(openai.NotFoundError) as hidden:
            sdk.models.retrieve("sim-chat")
    assert hidden.value.code == "model_not_found"
    with client(stack) as sdk:  # the tenant's own key is not restricted
        assert "sim-chat" in [m.id for m in sdk.models.list()]
