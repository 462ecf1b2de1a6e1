"""The official ``anthropic`` and ``openai`` SDKs against a live gateway and the real
bundled model: Anthropic's Messages API (whole and streamed) and embeddings. The
policy is the shipped one with the semantic cache on (it ships off): the
built-in embedding model runs only then."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import orjson
import pytest

from bench.shipped_policy import SEMANTIC_ON, shipped_policy_text
from hedgerow.sse import SseParser
from tests.support.stack import Stack, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
FRESH = {"cache-control": "no-cache"}  # a live generation, not a cached answer
# Current SDKs dropped sampling arguments (newer Claude models refuse them); the API has them.
ZERO = {"temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("anthropic")
    policy = root / "policy.yaml"
    policy.write_text(shipped_policy_text(SEMANTIC_ON))
    stack = Stack(root)
    try:
        stack.start_control_plane(policy=policy)
        stack.start_worker("w-main", "--slots", "2")
        stack.start_gateway()
        yield stack
    finally:
        stack.stop_all()


def _tls(stack: Stack) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=stack.ca_cert)


@pytest.fixture(scope="module")
def claude(stack: Stack) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack.gateway_url, api_key="sk-demo", max_retries=0,
                             http_client=anthropic.DefaultHttpxClient(verify=_tls(stack))
                             ) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="sk-demo", max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=_tls(stack))) as client:
        # The embedding model loads beside the gateway (seconds to a minute).
        wait_for(lambda: _embeds(client), "the embedding model", timeout=240)
        yield client


def _embeds(client: openai.OpenAI) -> bool:
    try:
        client.embeddings.create(model=EMBEDDING_MODEL, input="warm up")
    except openai.APIStatusError as error:
        if error.status_code != 503:
            raise
        return False
    return True


# -- Anthropic's Messages API ------------------------------------------------------------

def test_a_message_with_a_system_prompt(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=12, system="You are a terse assistant.",
        messages=[{"role": "user", "content": "Say hello to Ada."}], extra_headers=FRESH)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.input_tokens > 10  # the system prompt and the chat template count
    assert 0 < message.usage.output_tokens <= 12


def test_a_long_answer_stops_at_max_tokens(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=4,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Tell me a long story about a fox."}]}],
        extra_headers=FRESH, extra_body=ZERO)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 4)


def test_a_streamed_message_sends_anthropics_events(stack: Stack) -> None:
    """On the wire, as Anthropic sends them (the SDK hides the pings)."""
    body = {"model": MODEL, "max_tokens": 10, "stream": True,
            "messages": [{"role": "user", "content": "Name a colour."}]}
    headers = {**FRESH, "x-api-key": "sk-demo", "anthropic-version": "2023-06-01"}
    with httpx.Client(verify=_tls(stack), timeout=120) as http:
        response = http.post(stack.gateway_url + "/v1/messages", json=body, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [SseParser().feed(block.encode() + b"\n\n")[0]
              for block in response.text.strip().split("\n\n")]
    kinds = [event.event for event in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    payloads = [orjson.loads(event.data) for event in events]
    assert [p["type"] for p in payloads] == kinds
    deltas = [p["delta"]["text"] for p in payloads if p["type"] == "content_block_delta"]
    assert "".join(deltas).strip()
    end = payloads[-2]
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert 0 < end["usage"]["output_tokens"] <= 10 and end["usage"]["input_tokens"] > 0


def test_the_sdks_stream_helper_accumulates_the_same_message(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=MODEL, max_tokens=10,
                                system="Answer in one word.",
                                messages=[{"role": "user", "content": "Capital of France?"}],
                                extra_headers=FRESH) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].text == text
    assert final.id.startswith("msg_") and final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= 10
    assert final.usage.input_tokens > 0  # message_start has 0; message_delta has the count


def test_a_repeated_deterministic_message_is_answered_from_the_cache(
        claude: anthropic.Anthropic) -> None:
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "extra_body": ZERO,
                           "messages": [{"role": "user", "content": "Count to three."}]}
    first = claude.messages.with_raw_response.create(**ask)
    assert first.headers["x-hedgerow-cache"] == "miss"
    # Stored once the answer is complete, which may be just after the client read it.
    again = wait_for(lambda: _cached(claude.messages.with_raw_response.create(**ask)),
                     "the answer to be cached", timeout=30)
    assert again.parse().content == first.parse().content
    streamed = list(claude.messages.create(**ask, stream=True))
    text = "".join(e.delta.text for e in streamed if e.type == "content_block_delta")
    assert text == first.parse().content[0].text


def _cached(response: Any) -> Any:
    return response if response.headers["x-hedgerow-cache"] == "exact" else None


def test_a_bad_key_is_anthropics_authentication_error(stack: Stack) -> None:
    with anthropic.Anthropic(base_url=stack.gateway_url, api_key="sk-wrong", max_retries=0,
                             http_client=anthropic.DefaultHttpxClient(verify=_tls(stack))
                             ) as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client.messages.create(model=MODEL, max_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_what_the_workers_cannot_do_is_a_bad_request(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=4, extra_body={"top_k": 5},
                               messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "top_k" in caught.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nonexistent", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])


# -- embeddings ------------------------------------------------------------------------------

SENTENCES = ["The cat sits on the mat.", "A kitten is resting on the rug.",
             "Quarterly interest rates rose sharply."]


def test_embeddings_are_unit_vectors_that_know_similar_sentences(sdk: openai.OpenAI) -> None:
    answer = sdk.embeddings.create(model=EMBEDDING_MODEL, input=SENTENCES,
                                   encoding_format="float")
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == EMBEDDING_MODEL
    vectors = np.array([d.embedding for d in answer.data])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    similar, unrelated = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert similar > unrelated + 0.2
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(SENTENCES)


def test_base64_embeddings_decode_to_the_same_floats(sdk: openai.OpenAI) -> None:
    floats = sdk.embeddings.create(model=EMBEDDING_MODEL, input=SENTENCES[0],
                                   encoding_format="float").data[0].embedding
    raw = sdk.embeddings.create(model=EMBEDDING_MODEL, input=SENTENCES[0],
                                encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    decoded = np.frombuffer(__import__("base64").b64decode(raw), dtype="<f4")
    assert np.allclose(decoded, np.array(floats, dtype=np.float32), atol=1e-6)
    # The SDK's default asks for base64 and decodes it itself.
    default = sdk.embeddings.create(model=EMBEDDING_MODEL, input=SENTENCES[0]).data[0].embedding
    assert np.allclose(np.array(default), decoded, atol=1e-6)


def test_embeddings_refuse_what_they_cannot_honour(sdk: openai.OpenAI) -> None:
    for fields, param in [({"input": [[1, 2, 3]]}, "input"), ({"dimensions": 128}, "dimensions"),
                          ({"input": ["x"] * 257}, "input"), ({"input": ""}, "input")]:
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.embeddings.create(**{"model": EMBEDDING_MODEL, "input": "hi", **fields})
        assert caught.value.param == param
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="text-embedding-3-small", input="hi")
    assert EMBEDDING_MODEL in {m.id for m in sdk.models.list().data}
