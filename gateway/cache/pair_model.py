"""The semantic cache's judge on ONNX Runtime: does a cached question ask what the new one asks?

The model is MiniLM fine-tuned as a pair classifier (a cross-encoder) by
``hedgerow cache export-model`` (``gateway.cache.pair_export``); it reads both
questions together, as ``[CLS] new [SEP] cached [SEP]``, and gives one logit.
A pair's score is the lower of its two orders' probabilities: reuse must hold
both ways. Texts are normalized as the cache keys them
(``gateway.cache.keys.normalize_text``) and cut to ``MAX_PAIR_TOKENS`` word
pieces between them, as in training.

Like the embedder, it runs in the embedding sidecar (never in the gateway's
event-loop process) and needs only ``hedgerow[cache]`` (onnxruntime,
tokenizers, numpy). Blocking: call on a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gateway.cache.keys import normalize_text
from gateway.cache.onnx_minilm import (
    EXPORT_COMMAND,
    OPSET,
    cache_dir,
    complete_export,
    session_and_tokenizer,
)
from policies.schema import MAX_SEMANTIC_CANDIDATES

PAIR_EXPORT_NAME = f"all-minilm-l6-v2-pair-opset{OPSET}"
GRAPH = "pair.onnx"
MANIFEST = "pair.json"
MAX_PAIR_TOKENS = 128  # both questions together; cached chat questions are far shorter
MAX_CANDIDATES = MAX_SEMANTIC_CANDIDATES  # cached questions judged against one new one


class PairModelNotExported(FileNotFoundError):
    """No export of the pair model: semantic lookups that need it miss."""


def pair_export_dir() -> Path:
    return cache_dir() / PAIR_EXPORT_NAME


def read_pair_manifest(directory: Path) -> dict[str, object]:
    manifest = complete_export(directory, MANIFEST, GRAPH)
    if manifest is None:
        raise PairModelNotExported(
            f"no pair model for the semantic cache in {directory}: create it once with "
            f"`{EXPORT_COMMAND}` (needs pip install 'hedgerow[export]')")
    return manifest


class OnnxPairModel:
    """Pair scores in [0, 1] from an ONNX Runtime session."""

    def __init__(self, directory: Path, threads: int | None = 1) -> None:
        self.manifest = read_pair_manifest(directory)
        self.session, self.tokenizer = session_and_tokenizer(
            directory / GRAPH, threads, "the semantic cache's pair model")
        self.tokenizer.enable_truncation(max_length=MAX_PAIR_TOKENS)
        self.tokenizer.enable_padding()

    def probabilities(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """P(same question) for each (first, second), in that order only."""
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        encodings = self.tokenizer.encode_batch(list(pairs))
        feed = {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64)}
        (logits,) = self.session.run(None, feed)
        flat: np.ndarray = np.asarray(logits, dtype=np.float64).reshape(-1)
        return np.asarray(1.0 / (1.0 + np.exp(-flat)), dtype=np.float32)


def judge_many(model: OnnxPairModel, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
    """Scores of many (new, cached) pairs in one model call (both orders)."""
    texts = [(normalize_text(a), normalize_text(b)) for a, b in pairs]
    both = model.probabilities(texts + [(b, a) for a, b in texts])
    return np.asarray(np.minimum(both[:len(texts)], both[len(texts):]), dtype=np.float32)


def load_pair_model(threads: int | None = 1, directory: Path | None = None) -> OnnxPairModel:
    """The exported pair model. Never trains: raises PairModelNotExported (an
    OSError) without an export, ImportError without ``hedgerow[cache]``."""
    return OnnxPairModel(directory if directory is not None else pair_export_dir(), threads)
