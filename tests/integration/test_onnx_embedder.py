"""The embedding model on ONNX Runtime gives the vectors PyTorch gives, and is exported once."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from gateway.cache import onnx_minilm
from gateway.cache.embedder import BACKEND_ENV, encode, load_minilm
from gateway.cache.onnx_minilm import CACHE_ENV, OnnxMiniLm

TEXTS = [
    "How far is 5 km in miles?",
    "How far is 50 km in miles?",
    "Why is the sky blue?",
    "",  # empty: still one vector
    "hedge " * 600,  # longer than the model reads: truncated, not refused
    "Wie spät ist es in Zürich?",
]


@pytest.fixture(scope="module")
def torch_model() -> object:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BACKEND_ENV, "torch")
        return load_minilm(threads=1)


def test_onnx_vectors_match_sentence_transformers_in_a_padded_batch(
        torch_model: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = load_minilm(threads=1)
    assert isinstance(model, OnnxMiniLm)
    batched = encode(model, TEXTS)  # padded to the longest text
    reference = encode(torch_model, TEXTS)
    assert batched.shape == (len(TEXTS), 384) and batched.dtype == np.float32
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    assert float((batched * reference).sum(axis=1).min()) > 0.9999
    one_by_one = np.vstack([encode(model, [text]) for text in TEXTS])
    assert float((batched * one_by_one).sum(axis=1).min()) > 0.9999
    # The numbers guard's hard negative stays a different vector.
    assert float(batched[0] @ batched[1]) < 0.9999


def test_the_export_is_made_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    caplog.set_level(logging.INFO, "hedgerow.cache")
    load_minilm(threads=1)
    exported = list(tmp_path.glob("*.onnx"))
    assert len(exported) == 1 and not list(tmp_path.glob("*.partial"))
    made = exported[0].stat().st_mtime_ns
    assert sum("exporting" in r.message for r in caplog.records) == 1
    load_minilm(threads=1)
    assert exported[0].stat().st_mtime_ns == made
    assert sum("exporting" in r.message for r in caplog.records) == 1


def test_without_onnx_runtime_it_falls_back_to_pytorch(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def missing(model_dir: Path, threads: int | None = 1) -> OnnxMiniLm:
        raise ImportError("No module named 'onnxruntime'")

    monkeypatch.setattr("gateway.cache.embedder.load_onnx_minilm", missing)
    model = load_minilm(threads=1)
    assert not isinstance(model, OnnxMiniLm)
    assert encode(model, ["still works"]).shape == (1, 384)
    assert any("ONNX Runtime unavailable" in r.message for r in caplog.records)


def test_an_unwritable_export_cache_falls_back_to_pytorch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "onnx"))
    model = load_minilm(threads=1)
    assert not isinstance(model, OnnxMiniLm)
    assert onnx_minilm.cache_dir() == blocker / "onnx"
