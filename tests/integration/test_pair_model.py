"""The pair model's ONNX graph gives the scores torch gives, and the sidecar runs it.

Training the shipped judge takes ~30 minutes (``hedgerow cache export-model``);
here a model trained for a few steps is enough to check the export itself:
the graph, the tokenizer pairing and both orders agree with torch in a padded
batch. (The first version exported the model in training mode: dropout on,
scores off by 0.008; the score test below is what caught it.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from gateway.cache import pair_export
from gateway.cache.keys import normalize_text
from gateway.cache.onnx_export import packaged_model_dir
from gateway.cache.onnx_minilm import TOKENIZER
from gateway.cache.pair_model import GRAPH, MANIFEST, OnnxPairModel, judge_many

PAIRS = [
    ("How far is 5 km in miles?", "How many miles is 5 km?"),
    ("can dogs eat cat food", "can cats eat dog food"),
    ("what is a haiku", "write a haiku about autumn " * 20),  # longer than the model reads
    ("hi", "Wie spät ist es in Zürich?"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, Path]:
    pairs = pair_export.read_pairs(pair_export.training_files())[:32]
    model, tokenizer = pair_export.train(pairs, pair_export.Recipe(epochs=1))
    directory = tmp_path_factory.mktemp("pair")
    pair_export.export_graph(model, directory / GRAPH)
    shutil.copyfile(packaged_model_dir() / TOKENIZER, directory / TOKENIZER)
    (directory / MANIFEST).write_text("{}")
    return model, tokenizer, directory


def test_onnx_scores_match_torch_in_a_padded_batch_in_both_orders(
        trained: tuple[object, object, Path]) -> None:
    import torch

    model, tokenizer, directory = trained
    onnx = judge_many(OnnxPairModel(directory), PAIRS)
    texts = [(normalize_text(a), normalize_text(b)) for a, b in PAIRS]
    with torch.no_grad():
        orders = []
        for first, second in ((0, 1), (1, 0)):
            encoded = tokenizer([t[first] for t in texts], [t[second] for t in texts],  # type: ignore[operator]
                                padding=True, truncation=True,
                                max_length=pair_export.Recipe().max_tokens, return_tensors="pt")
            orders.append(torch.sigmoid(model(**encoded).logits.squeeze(-1)).numpy())  # type: ignore[operator]
    assert onnx.shape == (len(PAIRS),) and onnx.dtype == np.float32
    assert np.abs(onnx - np.minimum(*orders)).max() < 1e-4
    one_by_one = np.array([judge_many(OnnxPairModel(directory), [pair])[0] for pair in PAIRS])
    assert np.abs(onnx - one_by_one).max() < 1e-4
