"""POST /v1/embeddings: request checks, the response's encodings, the embedder behind it."""

from __future__ import annotations

import base64
from typing import Any

import anyio
import numpy as np
import pytest

from gateway.cache.embedder import EmbedderBusy
from gateway.corridor.embeddings import EmbeddingModel
from hedgerow import embeddings_api as api
from hedgerow.errors import EmbeddingsUnavailable, InvalidRequest


def refusal(**fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        api.parse({"model": api.MODEL, "input": "hi", **fields})
    assert caught.value.status == 400
    return caught.value


def test_input_is_one_text_or_a_list_of_them() -> None:
    assert api.parse({"model": api.MODEL, "input": "hi"}).texts() == ["hi"]
    parsed = api.parse({"model": api.MODEL, "input": ["a", "b"], "encoding_format": "base64",
                        "dimensions": 384, "user": "u-1"})
    assert parsed.texts() == ["a", "b"] and parsed.encoding_format == "base64"
    assert api.parse({"model": api.MODEL, "input": "hi", "dimensions": None}).dimensions is None


@pytest.mark.parametrize("fields, param, code", [
    ({"input": [1, 2, 3]}, "input", "unsupported_parameter"),
    ({"input": [[1, 2], [3]]}, "input", "unsupported_parameter"),
    ({"dimensions": 128}, "dimensions", "unsupported_parameter"),
    ({"encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": ["a", ""]}, "input.1", "invalid_value"),
    ({"input": ["a"] * (api.MAX_INPUTS + 1)}, "input", "invalid_value"),
    ({"input": "x" * (api.MAX_INPUT_CHARS + 1)}, "input", "invalid_value"),
    ({"input": 5}, "input", "invalid_value"),
    ({"input": None}, "input", "invalid_value"),
    ({"dimensions": "384"}, "dimensions", "invalid_value"),
    ({"truncate": True}, "truncate", "unknown_parameter"),
])
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict[str, Any], param: str,
                                                    code: str) -> None:
    error = refusal(**fields)
    assert (error.param, error.code) == (param, code)


def test_a_text_longer_than_the_models_window_is_refused_not_cut() -> None:
    api.check_token_counts([3, api.MAX_INPUT_TOKENS])
    with pytest.raises(InvalidRequest) as caught:
        api.check_token_counts([3, api.MAX_INPUT_TOKENS + 1])
    assert (caught.value.param, caught.value.code) == ("input.1", "input_too_long")


def test_the_response_in_floats_and_in_base64_holds_the_same_vector() -> None:
    vector = np.array([0.25, -1.5, 3.0], dtype=np.float32)
    floats = api.response_body([vector], "float", 7)
    assert floats == {"object": "list", "model": api.MODEL,
                      "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -1.5, 3.0]}],
                      "usage": {"prompt_tokens": 7, "total_tokens": 7}}
    packed = api.response_body([vector, vector], "base64", 7)["data"][1]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4"), vector)


class FakeEmbedder:
    dim = 3

    def __init__(self, busy_on: str = "", ready: bool = True) -> None:
        self.busy_on = busy_on
        self.ready = ready

    async def embed(self, text: str) -> np.ndarray:
        await anyio.sleep(0.001 * (5 - len(text) % 5))  # answers out of order
        if text == self.busy_on:
            raise EmbedderBusy("queue full")
        return np.array([len(text), 0, 0], dtype=np.float32)


class FakeTokenizer:
    class Encoding:
        def __init__(self, text: str) -> None:
            self.ids = list(range(len(text.split()) + 2))

    def encode_batch(self, texts: list[str]) -> list[FakeTokenizer.Encoding]:
        return [self.Encoding(t) for t in texts]


def test_the_embedder_answers_each_text_in_order() -> None:
    async def main() -> None:
        model = EmbeddingModel(FakeEmbedder(), FakeTokenizer())
        vectors = await model.embed(["a", "bbbb", "cc"])
        assert [int(v[0]) for v in vectors] == [1, 4, 2]
        assert await model.token_counts(["one two", "x"]) == [4, 3]

    anyio.run(main)


@pytest.mark.parametrize("embedder", [FakeEmbedder(busy_on="cc"), FakeEmbedder(ready=False)],
                         ids=["busy", "not running"])
def test_an_embedder_that_cannot_answer_is_a_503_to_retry(embedder: FakeEmbedder) -> None:
    async def main() -> None:
        with pytest.raises(EmbeddingsUnavailable) as caught:
            await EmbeddingModel(embedder, FakeTokenizer()).embed(["a", "cc", "ddd"])
        assert caught.value.status == 503 and caught.value.headers() == [(b"retry-after", b"1")]

    anyio.run(main)
