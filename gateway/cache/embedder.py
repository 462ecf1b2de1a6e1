"""Sentence embeddings off the event loop, batched under load.

``MiniLmEmbedder`` is an actor: ``run`` loads all-MiniLM-L6-v2 (its ONNX
export, ``gateway.cache.onnx_minilm``; no torch, no hub access) on a worker thread, then
takes queued texts in batches, encodes each batch with one model call on a
worker thread, and wakes the callers. While one batch is encoding, new texts
queue up and go together in the next one, so batches grow exactly when load
does. The queue is bounded: a full queue refuses at once (the caller treats
that as a semantic miss) instead of adding latency.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import numpy as np
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from gateway.cache.onnx_minilm import OnnxMiniLm, load_onnx_minilm

log = logging.getLogger("hedgerow.cache")
T = TypeVar("T")

DIM = 384
MAX_BATCH = 32
MAX_PENDING = 512
MAX_TEXT_CHARS = 2000  # the model reads 256 word pieces; more text only costs time
BACKEND_ENV = "HEDGEROW_EMBED_BACKEND"  # onnx (default) or torch (needs hedgerow[export])


class EmbedderBusy(Exception):
    """No embedding now (not started, queue full, or the model failed): a miss."""


class Embedder(Protocol):
    dim: int

    async def embed(self, text: str) -> np.ndarray: ...


class PairJudge(Protocol):
    """The semantic cache's judge (``gateway.cache.pair_model``, in the sidecar)."""

    async def judge(self, question: str, cached: Sequence[str]) -> np.ndarray:
        """One score in 0..1 per cached question; EmbedderBusy when it cannot."""
        ...


def load_minilm(threads: int | None = None) -> Any:
    """The bundled all-MiniLM-L6-v2 on the CPU: its ONNX export on ONNX Runtime
    (``gateway.cache.onnx_minilm``), which needs no torch. Raises
    ``ModelNotExported`` (an OSError) when there is no export yet, ImportError
    when ``hedgerow[cache]`` is missing; it never exports by itself (that is
    ``hedgerow cache export-model``). ``$HEDGEROW_EMBED_BACKEND=torch`` runs the
    packaged model as a SentenceTransformer instead, for comparisons (tests,
    benchmarks); it needs ``hedgerow[export]``."""
    if os.environ.get(BACKEND_ENV, "onnx") == "torch":
        return load_torch_minilm(threads)
    return load_onnx_minilm(threads)


def load_torch_minilm(threads: int | None = None) -> Any:
    from gateway.cache.onnx_export import packaged_model_dir

    model_dir = packaged_model_dir()
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as error:
        raise ImportError(f"the PyTorch embedder needs {error.name}: "
                          "pip install 'hedgerow[export]'") from error
    if threads:
        torch.set_num_threads(threads)
    return SentenceTransformer(str(model_dir), device="cpu")


def encode(model: Any, texts: Sequence[str]) -> np.ndarray:
    """Unit-length float32 vectors, one row per text (blocking: call on a thread)."""
    clipped = [t[:MAX_TEXT_CHARS] for t in texts]
    if isinstance(model, OnnxMiniLm):
        return model.encode(clipped)
    vectors = model.encode(clipped, batch_size=MAX_BATCH,
                           normalize_embeddings=True, convert_to_numpy=True,
                           show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


async def next_batch(receive: MemoryObjectReceiveStream[T], max_batch: int) -> list[T]:
    """Wait for one item, then take whatever else is already queued, up to
    ``max_batch``: batches grow exactly when load does."""
    batch = [await receive.receive()]
    while len(batch) < max_batch:
        try:
            batch.append(receive.receive_nowait())
        except anyio.WouldBlock:
            break
    return batch


@dataclass
class _Pending:
    text: str
    done: anyio.Event = field(default_factory=anyio.Event)
    vector: np.ndarray | None = None
    error: str | None = None


class MiniLmEmbedder:
    dim = DIM

    def __init__(self, *, max_batch: int = MAX_BATCH, max_pending: int = MAX_PENDING,
                 threads: int | None = 1, model: Any = None) -> None:
        self.max_batch = max_batch
        self.threads = threads
        self._model = model
        self._send, self._receive = anyio.create_memory_object_stream[_Pending](max_pending)
        self.ready = False
        self.batches = 0
        self.embedded = 0
        self.refused = 0

    async def embed(self, text: str) -> np.ndarray:
        if not self.ready:
            self.refused += 1
            raise EmbedderBusy("embedding model not loaded yet")
        pending = _Pending(text)
        try:
            self._send.send_nowait(pending)
        except anyio.WouldBlock:
            self.refused += 1
            raise EmbedderBusy("embedding queue full") from None
        await pending.done.wait()
        if pending.vector is None:
            raise EmbedderBusy(pending.error or "embedding failed")
        return pending.vector

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the model, then serve batches until cancelled."""
        if self._model is None:
            try:
                self._model = await anyio.to_thread.run_sync(load_minilm, self.threads)
                # The first call pays lazy initialisation (seconds on a busy machine):
                # pay it here, not in the first request's lookup or store.
                await anyio.to_thread.run_sync(encode, self._model, ["warm up"])
            except (ImportError, OSError) as error:  # not installed: exact caching only
                log.error("semantic cache off: cannot load the embedding model: %s", error)
                return
        self.ready = True
        task_status.started()
        try:
            while True:
                await self._encode(await next_batch(self._receive, self.max_batch))
        finally:
            self.ready = False

    async def _encode(self, batch: list[_Pending]) -> None:
        try:
            vectors = await anyio.to_thread.run_sync(encode, self._model, [p.text for p in batch])
        except (RuntimeError, ValueError) as error:  # a model failure fails this batch only
            log.warning("embedding a batch of %d failed: %s", len(batch), error)
            vectors = None
            for pending in batch:
                pending.error = str(error)
        self.batches += 1
        self.embedded += len(batch)
        for row, pending in enumerate(batch):
            if vectors is not None:
                pending.vector = vectors[row]
            pending.done.set()
