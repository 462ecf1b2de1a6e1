"""A simulated embedding model (``--backend sim --sim-embedding-model NAME``; sans-IO).

For tests and benchmarks of the gateway's forwarding of ``POST /v1/embeddings``
to a registered worker, never for users: each text's vector is a function of
the text and the seed alone (a unit vector from its SHA-256), so a test knows
the answer in advance. Requests are checked as the gateway checks them
(``hedgerow.embeddings_api``); ``usage`` counts whitespace-separated words.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from hedgerow import embeddings_api
from hedgerow.api_params import unsupported
from hedgerow.errors import ModelNotFound

DIMENSIONS = 8


def sim_vector(text: str, seed: int = 0, dimensions: int = DIMENSIONS) -> np.ndarray:
    """The unit vector the simulated model gives ``text``."""
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    raw = np.frombuffer(digest[:dimensions], dtype=np.uint8).astype(np.float32) - 127.5
    return raw / np.linalg.norm(raw)


class SimEmbedder:
    def __init__(self, model_name: str, seed: int | None = None) -> None:
        self.model_name = model_name
        self.seed = seed or 0

    def answer(self, request_json: Mapping[str, Any]) -> dict[str, Any]:
        """OpenAI's embeddings answer for a request, or the ``HedgerowError`` to send."""
        parsed = embeddings_api.parse(request_json)
        if parsed.model != self.model_name:
            raise ModelNotFound(f"the embedding model {parsed.model!r} is not served here",
                                param="model")
        if parsed.dimensions is not None and parsed.dimensions != DIMENSIONS:
            raise unsupported("dimensions", f"{self.model_name} has {DIMENSIONS} only")
        texts = parsed.texts()
        body = embeddings_api.response_body([sim_vector(t, self.seed) for t in texts],
                                            parsed.encoding_format,
                                            sum(len(t.split()) for t in texts))
        return {**body, "model": self.model_name}
