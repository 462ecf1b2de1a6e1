"""The embedding model on ONNX Runtime gives the vectors PyTorch gives; it is
exported once by an explicit step, and run without torch; without an export
the gateway's sidecar says how to make one, once, and the semantic cache is off."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

from gateway.cache.embed_sidecar import SidecarEmbedder
from gateway.cache.embedder import BACKEND_ENV, encode, load_minilm
from gateway.cache.onnx_export import export_model
from gateway.cache.onnx_minilm import CACHE_ENV, EXPORT_NAME, ModelNotExported, OnnxMiniLm

TEXTS = [
    "How far is 5 km in miles?",
    "How far is 50 km in miles?",
    "Why is the sky blue?",
    "",  # empty: still one vector
    "hedge " * 600,  # longer than the model reads: truncated, not refused
    "Wie spät ist es in Zürich?",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One export into a fresh cache directory, as `hedgerow cache export-model` makes it."""
    directory, made = export_model(target=tmp_path_factory.mktemp("onnx") / EXPORT_NAME)
    assert made
    return directory


@pytest.fixture(scope="module")
def torch_model() -> object:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BACKEND_ENV, "torch")
        return load_minilm(threads=1)


def test_onnx_vectors_match_sentence_transformers_in_a_padded_batch(
        torch_model: object, exported: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(exported.parent))
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


def test_the_export_is_made_once_and_reused_until_forced(exported: Path) -> None:
    graph = exported / "model.onnx"
    made = graph.stat().st_mtime_ns
    assert export_model(target=exported) == (exported, False)
    assert graph.stat().st_mtime_ns == made
    assert not list(exported.parent.glob("*.partial")) and not list(exported.parent.glob("*.old"))


def test_the_embedder_runs_from_the_export_without_importing_torch(exported: Path) -> None:
    script = ("import sys; from gateway.cache.embedder import encode, load_minilm; "
              "v = encode(load_minilm(1), ['hello']); "
              "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
              "('torch', 'sentence_transformers', 'transformers', 'onnx')); "
              "print(v.shape, heavy)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, CACHE_ENV: str(exported.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(1, 384) []"


def test_without_an_export_loading_says_how_to_make_one(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelNotExported, match="hedgerow cache export-model"):
        load_minilm(threads=1)
    assert not list(tmp_path.iterdir()), "loading never exports"


def test_without_an_export_the_sidecar_turns_semantic_off_with_one_clear_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    embedder = SidecarEmbedder(start_timeout_s=60)  # the real server, as the gateway starts it

    async def run() -> None:
        with anyio.fail_after(60):
            await embedder.run()  # returns: starting it again would not help

    anyio.run(run)
    assert not embedder.ready and embedder.starts == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1, errors
    assert errors[0].startswith("semantic cache off") and "`hedgerow cache export-model`" in errors[0]
    assert str(tmp_path) in errors[0]


def test_export_model_into_an_unwritable_place_fails_with_the_reason(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "hedgerow.cli", "cache", "export-model"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, CACHE_ENV: str(blocker / "onnx")})
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hedgerow cache export-model:") and "not-a-directory" in last


def test_the_embeddings_route_counts_tokens_with_the_exports_tokenizer_or_says_503(
        exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.corridor.embeddings import load_tokenizer
    from hedgerow.errors import EmbeddingsUnavailable

    monkeypatch.setenv(CACHE_ENV, str(exported.parent))
    # [CLS] how far is 5 km in miles ? [SEP]
    assert len(load_tokenizer().encode("How far is 5 km in miles?").ids) == 10
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # no export: unavailable, not a crash
    with pytest.raises(EmbeddingsUnavailable, match="hedgerow cache export-model"):
        load_tokenizer()
