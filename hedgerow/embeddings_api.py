"""OpenAI's embeddings request and response (``POST /v1/embeddings``; sans-IO).

Served from the embedding model the gateway already runs for its semantic
cache (all-MiniLM-L6-v2, 384 dimensions, unit-length vectors), or forwarded
to a worker or upstream that offers the requested model (``gateway.corridor.embed_route``),
checked here the same way but for ``dimensions``, which is that model's to judge. Every field
is checked as ``hedgerow.api_params.EMBEDDINGS_PARAMS`` says: ``input`` as a
string or a list of strings (token arrays are refused: the ids would be
another model's), ``encoding_format`` ``float`` or ``base64`` (little-endian
float32, as OpenAI's), ``dimensions`` only the model's own, ``user`` accepted.
Bounds are Hedgerow's: at most ``MAX_INPUTS`` texts of at most
``MAX_INPUT_CHARS`` characters and the model's token window each, since the
model would silently cut a longer text -- a 400 says so instead.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hedgerow.api_params import EMBEDDINGS_PARAMS, check_fields, unsupported
from hedgerow.errors import InvalidRequest
from hedgerow.pydantic_errors import invalid_value

MODEL = "all-minilm-l6-v2"
# Other names clients use for the same model.
MODEL_ALIASES = frozenset({MODEL, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"})
DIMENSIONS = 384
MAX_INPUTS = 256
MAX_INPUT_CHARS = 2000  # the embedder's own clip (gateway.cache.embedder.MAX_TEXT_CHARS)
MAX_INPUT_TOKENS = 256  # the model's window (its max_seq_length), special tokens included

Text = Annotated[str, Field(strict=True, min_length=1, max_length=MAX_INPUT_CHARS)]


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, strict=True)
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, strict=True)
    user: Annotated[str, Field(strict=True, max_length=1024)] | None = None

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def parse(data: Mapping[str, Any]) -> EmbeddingsRequest:
    """A validated request, or ``InvalidRequest`` naming the field at fault."""
    check_fields(data, EMBEDDINGS_PARAMS, "")
    _refuse_token_arrays(data.get("input"))
    given = {k: v for k, v in data.items() if v is not None or k in ("model", "input")}
    try:
        parsed = EmbeddingsRequest.model_validate(given)
    except ValidationError as error:
        raise invalid_value(error) from None
    # Another model's dimensions are for the worker or upstream serving it to judge.
    own = parsed.model in MODEL_ALIASES
    if own and parsed.dimensions is not None and parsed.dimensions != DIMENSIONS:
        raise unsupported("dimensions", f"{MODEL} has {DIMENSIONS} dimensions only")
    return parsed


def _refuse_token_arrays(value: Any) -> None:
    if isinstance(value, list) and any(
            isinstance(item, int) or isinstance(item, list) for item in value):
        raise unsupported("input", "token arrays: send the text itself")


def check_token_counts(counts: Sequence[int]) -> None:
    """Every text fits the model's window (it would be cut silently otherwise)."""
    for index, count in enumerate(counts):
        if count > MAX_INPUT_TOKENS:
            raise InvalidRequest(f"input {index} is {count} tokens long; {MODEL} reads at "
                                 f"most {MAX_INPUT_TOKENS}", param=f"input.{index}",
                                 code="input_too_long")


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in np.asarray(vector, dtype=np.float32)]


def response_body(vectors: Sequence[np.ndarray], encoding_format: str,
                  prompt_tokens: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": index,
                  "embedding": encoded(vector, encoding_format)}
                 for index, vector in enumerate(vectors)],
        "model": MODEL,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
