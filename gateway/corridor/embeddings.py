"""``POST /v1/embeddings``: vectors from the embedder the semantic cache runs.

No second copy of the model: the texts go to the cache's ``Embedder`` (by
default the MiniLM sidecar process, which batches them with the cache's own
embeds), so nothing is encoded on the event loop. The token counts for
``usage`` and for the window check come from the model's own
``tokenizer.json`` (the Rust ``tokenizers`` library, a few MB, no torch),
run on a worker thread.

The embedder runs when the policy's semantic cache is enabled (it ships
off); while it loads or is restarting, or when its queue is full, a request
is a ``503 embeddings_unavailable`` with ``Retry-After``. While the policy
leaves it off the model is not served at all: ``404 model_not_found``, as
``/v1/models`` does not list it (``gateway.embedding_routes``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from gateway.cache.embedder import Embedder, EmbedderBusy
from gateway.cache.onnx_minilm import TOKENIZER, export_dir
from hedgerow.errors import EmbeddingsUnavailable

log = logging.getLogger("hedgerow.gateway.embeddings")

EMBED_TIMEOUT_S = 30.0  # a whole request's texts, queued behind the cache's embeds


def load_tokenizer() -> Any:
    """The model's own tokenizer, without the truncation or padding it may carry
    (blocking: call on a worker thread). It is the copy in the ONNX export the
    embedder runs (``hedgerow cache export-model``), so a gateway installed
    without the weights' package (``hedgerow[gateway,cache]``) counts tokens
    too; no export, or no ``tokenizers``: 503 ``embeddings_unavailable``."""
    path = export_dir() / TOKENIZER
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise _unavailable(f"the embedding model's tokenizer needs {error.name}: "
                           "pip install 'hedgerow[cache]'") from error
    if not path.is_file():  # checked here: tokenizers says only "Exception" for a missing file
        raise _unavailable(f"no export of the embedding model at {path.parent}: "
                           "`hedgerow cache export-model` makes it")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class EmbeddingModel:
    """The embedder and the tokenizer behind the embeddings route."""

    def __init__(self, embedder: Embedder, tokenizer: Any = None) -> None:
        self.embedder = embedder
        self._tokenizer = tokenizer
        self._loading = anyio.Lock()

    def ready(self) -> bool:
        return bool(getattr(self.embedder, "ready", True))

    async def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Each text's tokens, special ones included (what the model's window holds)."""
        tokenizer = await self._tokenizer_loaded()
        encodings = await anyio.to_thread.run_sync(tokenizer.encode_batch, list(texts))
        return [len(encoding.ids) for encoding in encodings]

    async def embed(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One unit vector per text, in order; ``EmbeddingsUnavailable`` (503) if
        the embedder is not running, is full, or is too slow."""
        if not self.ready():
            raise _unavailable("the embedding model is not running (it is loading, restarting, "
                               "or the policy's semantic cache is off)")
        vectors: list[np.ndarray | None] = [None] * len(texts)
        refused: list[str] = []

        async def one(index: int, text: str) -> None:
            try:
                vectors[index] = await self.embedder.embed(text)
            except EmbedderBusy as busy:  # the others finish; the request fails below
                refused.append(str(busy))

        with anyio.move_on_after(EMBED_TIMEOUT_S) as waited:
            async with anyio.create_task_group() as tg:
                for index, text in enumerate(texts):
                    tg.start_soon(one, index, text)
        if waited.cancelled_caught:
            raise _unavailable("the embedding model did not answer in time")
        if refused:
            log.warning("embeddings refused (%d of %d texts): %s", len(refused), len(texts),
                        refused[0])
            raise _unavailable("the embedding model is busy; retry shortly")
        return [v for v in vectors if v is not None]

    async def _tokenizer_loaded(self) -> Any:
        async with self._loading:
            if self._tokenizer is None:
                self._tokenizer = await anyio.to_thread.run_sync(load_tokenizer)
        return self._tokenizer


def _unavailable(message: str) -> EmbeddingsUnavailable:
    return EmbeddingsUnavailable(message, retry_after=1)
