"""all-MiniLM-L6-v2 on ONNX Runtime: what the gateway's embedder runs, without torch.

PyTorch spends most of a one-sentence embedding on per-operator overhead: on
the 2-core development VM a short question took ~27 ms p50 through
sentence-transformers and ~12 ms through ONNX Runtime, with vectors equal to
float precision (cosine > 0.9999). And torch is a large install a gateway
should not carry, so at run time only this module's dependencies are needed
(``hedgerow[cache]``: onnxruntime, tokenizers, numpy).

The model comes from an *export*: a directory made once per machine or image
by ``hedgerow cache export-model`` (``gateway.cache.onnx_export``, which needs
``hedgerow[export]``: torch and the packaged weights), in
``~/.cache/hedgerow/onnx`` or ``$HEDGEROW_ONNX_CACHE``. It holds the graph
(``model.onnx``), the model's own ``tokenizer.json`` (the fast tokenizer
sentence-transformers uses) and ``export.json`` (where the weights came from,
and how many word pieces the model reads). Pooling is the mean over the real
tokens, then unit length, as the model's ``1_Pooling`` and ``Normalize``
modules do.

Blocking: load and call on a worker thread or in the embedding sidecar.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("hedgerow.cache")

CACHE_ENV = "HEDGEROW_ONNX_CACHE"
OPSET = 17
EXPORT_NAME = f"all-minilm-l6-v2-opset{OPSET}"  # a new opset is a new export
GRAPH = "model.onnx"
TOKENIZER = "tokenizer.json"
MANIFEST = "export.json"
EXPORT_COMMAND = "hedgerow cache export-model"
MISSING_EXTRA = "pip install 'hedgerow[cache]'"


class ModelNotExported(FileNotFoundError):
    """No export of the model where the embedder looks: the semantic cache stays off."""


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "hedgerow" / "onnx"


def export_dir() -> Path:
    return cache_dir() / EXPORT_NAME


def read_manifest(directory: Path) -> dict[str, object]:
    """The export's manifest; raises ModelNotExported when the export is absent or partial."""
    manifest = complete_export(directory, MANIFEST, GRAPH)
    if manifest is None:
        raise ModelNotExported(
            f"no ONNX export of all-MiniLM-L6-v2 in {directory}: create it once with "
            f"`{EXPORT_COMMAND}` (needs pip install 'hedgerow[export]'; "
            f"${CACHE_ENV} moves it)")
    return manifest


def complete_export(directory: Path, manifest: str, graph: str) -> dict[str, object] | None:
    """An export directory's manifest if the manifest, the graph and the tokenizer are all there."""
    try:
        found = json.loads((directory / manifest).read_text())
    except (OSError, ValueError):
        return None
    missing = [name for name in (graph, TOKENIZER) if not (directory / name).is_file()]
    return found if isinstance(found, dict) and not missing else None


def session_and_tokenizer(graph: Path, threads: int | None, what: str) -> tuple[Any, Any]:
    """An ONNX Runtime session on ``graph`` (CPU, ``threads`` intra-op; 0: all) and the
    fast tokenizer beside it; ImportError naming ``what`` without ``hedgerow[cache]``."""
    try:
        import onnxruntime
        from tokenizers import Tokenizer
    except ImportError as error:
        raise ImportError(f"{what} needs {error.name}: {MISSING_EXTRA}") from error
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads or 0
    options.inter_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    return session, Tokenizer.from_file(str(graph.parent / TOKENIZER))


class OnnxMiniLm:
    """Sentence embeddings from an ONNX Runtime session (unit-length float32 rows)."""

    def __init__(self, directory: Path, threads: int | None = 1) -> None:
        manifest = read_manifest(directory)
        self.session, self.tokenizer = session_and_tokenizer(
            directory / GRAPH, threads, "the semantic cache's embedder")
        self.tokenizer.enable_truncation(max_length=int(str(manifest.get("max_tokens", 256))))
        self.tokenizer.enable_padding()  # to the longest text of a batch
        self.manifest = manifest

    def encode(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        (hidden,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask,
                                            "token_type_ids": types})
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(pooled / norms, dtype=np.float32)


def load_onnx_minilm(threads: int | None = 1, directory: Path | None = None) -> OnnxMiniLm:
    """The exported model on ONNX Runtime. Never exports: raises ModelNotExported
    (an OSError) when there is no export, ImportError when ``hedgerow[cache]``
    is not installed; the embedding sidecar turns either into one log line."""
    return OnnxMiniLm(directory if directory is not None else export_dir(), threads)
