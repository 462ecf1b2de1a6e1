"""The semantic cache's judge, made once per machine: MiniLM fine-tuned as a pair classifier.

    hedgerow cache export-model [--force]      (exports the embedder, then this)

The embedder (``gateway.cache.onnx_export``) finds the cached questions
nearest a new one; this model decides whether one of them asks the same
thing, reading the two questions *together* (a cross-encoder). It starts from
the same packaged all-MiniLM-L6-v2 weights with a one-logit head and is
fine-tuned here, on the labelled pairs shipped in
``gateway/cache/training/`` (``TRAINING_SETS``) plus negatives mined from
them (``mined_negatives``: each question's nearest other question, the kind
of candidate the cache hands the judge), with fixed hyper-parameters
(``Recipe``: binary cross-entropy, both orders of every pair, 4 epochs,
batch 16, AdamW lr 3e-5 with 10 % warm-up then linear decay, seed 0; two
epochs left it underfit on the 2.5 times larger data, see docs/benchmarks.md). Then ``torch.onnx.export`` writes
the graph (logits out) that ``gateway.cache.pair_model`` runs without torch.

No weights are committed or downloaded: the result is a build output of the
packaged weights, the training pairs and the recipe. ``pair.json`` names the
three (sha256s and the recipe), so a later run is a no-op while they are the
same. Training takes about thirty minutes on two cores; the directory is built
beside its final place and renamed into it (``onnx_export.publish_export``).

The sets it trains on are never the sets it is judged on: ``bench/data``
keeps ``paraphrases_sealed4.jsonl`` (the development set the shipped
threshold was chosen on) and ``paraphrases_sealed5.jsonl`` (never used for
any choice). The older sealed sets, looked at once each, are training data
now, with ``pairs_far_train.jsonl`` (far rewordings, written for training).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gateway.cache.keys import normalize_text
from gateway.cache.onnx_export import (
    MISSING_EXTRA,
    MODEL_PACKAGE,
    export_bert,
    packaged_model_dir,
    publish_export,
    weights_sha256,
)
from gateway.cache.onnx_minilm import OPSET, TOKENIZER
from gateway.cache.pair_model import (
    GRAPH,
    MANIFEST,
    MAX_PAIR_TOKENS,
    PairModelNotExported,
    pair_export_dir,
    read_pair_manifest,
)

log = logging.getLogger("hedgerow.cache")

TRAINING_DIR = Path(__file__).with_name("training")
TRAINING_SETS = ("paraphrases_first.jsonl", "paraphrases_holdout.jsonl",
                 "paraphrases_fresh.jsonl", "paraphrases_sealed.jsonl", "pairs_train.jsonl",
                 "paraphrases_sealed2.jsonl", "paraphrases_sealed3.jsonl", "pairs_far_train.jsonl")


@dataclass(frozen=True)
class LabelledPair:
    a: str
    b: str
    label: int


@dataclass(frozen=True)
class Recipe:
    """How the judge is trained; part of the export's identity."""

    epochs: int = 4
    batch: int = 16
    lr: float = 3e-5
    weight_decay: float = 0.01
    warmup: float = 0.1
    seed: int = 0
    max_tokens: int = MAX_PAIR_TOKENS
    # Mined negatives (``mined_negatives``): the nearest other question within these cosines.
    mined_floor: float = 0.3
    mined_ceiling: float = 0.85
    # Retyped questions as positives (``typing_positives``): one text in this many; 0: none
    # (8 with pairs_mined_hard.jsonl was candidate D, which did not ship: docs/benchmarks.md).
    retyped_every: int = 0


def training_files() -> list[Path]:
    return [TRAINING_DIR / name for name in TRAINING_SETS]


def read_pairs(paths: Sequence[Path]) -> list[LabelledPair]:
    pairs = []
    for path in paths:
        for line in path.read_bytes().splitlines():
            if line.strip():
                row = orjson.loads(line)
                pairs.append(LabelledPair(row["a"], row["b"], int(row["label"])))
    return pairs


def mined_negatives(pairs: Sequence[LabelledPair], vectors: dict[str, np.ndarray],
                    recipe: Recipe) -> list[LabelledPair]:
    """Negatives of the kind the cache hands the judge: for each question of the
    training pairs, the nearest *other* question (by MiniLM cosine, within
    ``mined_floor``..``mined_ceiling``) that no labelled paraphrase links it to.

    The labelled sets hold only hard negatives (one fact changed), so a judge
    trained on them alone learns "same topic, nothing small changed: the
    same question" and passes two different questions of one domain; the
    cache's candidates are exactly such neighbours. Above the ceiling a
    neighbour from another pair is too likely a paraphrase nobody labelled.
    ``vectors``: unit embeddings of every normalized text. Deterministic."""
    texts = sorted(vectors)
    linked = paraphrase_groups(pairs)
    matrix = np.stack([vectors[t] for t in texts])
    similarity = matrix @ matrix.T
    mined: dict[tuple[str, str], LabelledPair] = {}
    for i, text in enumerate(texts):
        for j in np.argsort(-similarity[i], kind="stable").tolist():
            other = texts[j]
            score = float(similarity[i, j])
            if score < recipe.mined_floor:
                break
            if j == i or score > recipe.mined_ceiling or linked(text) == linked(other):
                continue
            mined.setdefault((min(text, other), max(text, other)), LabelledPair(text, other, 0))
            break
    return list(mined.values())


def _without_mark(question: str) -> str:
    return question[:-1] if question.endswith(("?", ".")) else question


def _lower_first(question: str) -> str:
    return question[:1].lower() + question[1:] if question[1:2].islower() else question


# How people retype a question without changing what it asks. Not the retypings
# bench.typing_variants checks (all lower case, a comma after the first word,
# " please"): those stay a test the judge was not trained for.
RETYPINGS: tuple[Callable[[str], str], ...] = (
    lambda q: f"can you tell me {_lower_first(_without_mark(q))}?",
    lambda q: f"quick question: {q}",
    lambda q: f"hey, {_lower_first(q)}",
    lambda q: f"{_without_mark(q)}? thanks",
    lambda q: f"so {_lower_first(q)}",
)


def typing_positives(pairs: Sequence[LabelledPair], every: int) -> list[LabelledPair]:
    """Each of one in ``every`` distinct training texts (chosen by its sha256) with
    one retyping of it (``RETYPINGS``, by the same hash), as a labelled paraphrase.

    A judge trained only on pairs that change one fact in otherwise identical
    words learns that near-identical wording means a different question; it
    scored "How far is 5 km in miles?" against itself without the "?" at 0.005
    (docs/benchmarks.md). Deterministic."""
    if every <= 0:
        return []
    texts = sorted({normalize_text(t) for p in pairs for t in (p.a, p.b)})
    retyped = []
    for text in texts:
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
        if digest % every == 0:
            variant = normalize_text(RETYPINGS[digest // every % len(RETYPINGS)](text))
            if variant != text:
                retyped.append(LabelledPair(text, variant, 1))
    return retyped


def paraphrase_groups(pairs: Sequence[LabelledPair]) -> Callable[[str], str]:
    """Each text's group: texts joined by labelled paraphrases (union-find)."""
    parent: dict[str, str] = {}

    def find(text: str) -> str:
        parent.setdefault(text, text)
        while parent[text] != text:
            parent[text] = parent[parent[text]]
            text = parent[text]
        return text

    for pair in pairs:
        a, b = normalize_text(pair.a), normalize_text(pair.b)
        if pair.label == 1:
            parent[find(a)] = find(b)
    return find


def training_sha256(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def train(pairs: Sequence[LabelledPair], recipe: Recipe = Recipe(),
          model_dir: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): MiniLM with a one-logit head, fine-tuned on ``pairs``
    in both orders. Deterministic for a given machine (CPU, seeded)."""
    try:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
    except ImportError as error:
        raise ImportError(f"training the pair model needs {error.name}: "
                          f"{MISSING_EXTRA}") from error

    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    path = str(model_dir if model_dir is not None else packaged_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "newly initialized: classifier.*" is the point
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    examples = [(normalize_text(p.a), normalize_text(p.b), float(p.label)) for p in pairs]
    examples += [(b, a, y) for a, b, y in examples]
    steps = recipe.epochs * ((len(examples) + recipe.batch - 1) // recipe.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr,
                                  weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / (recipe.warmup * steps)) * max(0.0, (steps - s) / steps))
    loss_of = torch.nn.BCEWithLogitsLoss()
    started = time.monotonic()
    for epoch in range(recipe.epochs):
        model.train()
        rng.shuffle(examples)
        total = 0.0
        for i in range(0, len(examples), recipe.batch):
            chunk = examples[i:i + recipe.batch]
            encoded = tokenizer([c[0] for c in chunk], [c[1] for c in chunk], padding=True,
                                truncation=True, max_length=recipe.max_tokens,
                                return_tensors="pt")
            loss = loss_of(model(**encoded).logits.squeeze(-1),
                           torch.tensor([c[2] for c in chunk]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * len(chunk)
        print(f"pair model: epoch {epoch + 1}/{recipe.epochs}, loss "
              f"{total / len(examples):.4f} ({time.monotonic() - started:.0f} s)",
              file=sys.stderr, flush=True)
    model.eval()
    return model, tokenizer


def embed_texts(pairs: Sequence[LabelledPair]) -> dict[str, np.ndarray]:
    """Every normalized text of ``pairs``, embedded by the cache's own embedder
    (its ONNX export, made just before by ``hedgerow cache export-model``)."""
    from gateway.cache.embedder import encode, load_minilm

    texts = sorted({normalize_text(t) for p in pairs for t in (p.a, p.b)})
    model = load_minilm(threads=max(1, min(4, os.cpu_count() or 1)))
    vectors = np.concatenate([encode(model, texts[i:i + 256]) for i in range(0, len(texts), 256)])
    return dict(zip(texts, vectors))


def export_identity(model_dir: Path | None = None, recipe: Recipe = Recipe()) -> dict[str, Any]:
    """What names an export: the weights, the training pairs and the recipe."""
    model_dir = model_dir if model_dir is not None else packaged_model_dir()
    return {"weights_sha256": weights_sha256(model_dir),
            "training_sha256": training_sha256(training_files()), "recipe": asdict(recipe)}


def is_current(directory: Path, identity: dict[str, Any]) -> bool:
    try:
        manifest = read_pair_manifest(directory)
    except PairModelNotExported:
        return False
    return all(manifest.get(name) == value for name, value in identity.items())


def export_pair_model(*, force: bool = False, model_dir: Path | None = None,
                      target: Path | None = None,
                      recipe: Recipe = Recipe()) -> tuple[Path, bool]:
    """Train and export unless an export of the same weights, pairs and recipe is
    there; returns (directory, exported)."""
    model_dir = model_dir if model_dir is not None else packaged_model_dir()
    target = target if target is not None else pair_export_dir()
    files = training_files()
    identity = export_identity(model_dir, recipe)
    if not force and is_current(target, identity):
        return target, False
    threads = max(1, min(4, os.cpu_count() or 1))
    log.info("training the semantic cache's pair model (a few minutes): %s", target)
    import torch

    torch.set_num_threads(threads)
    labelled = read_pairs(files)
    mined = mined_negatives(labelled, embed_texts(labelled), recipe)
    retyped = typing_positives(labelled, recipe.retyped_every)
    pairs = labelled + mined + retyped
    model, _ = train(pairs, recipe, model_dir)

    def write(partial: Path) -> None:
        torch_version = export_graph(model, partial / GRAPH)
        shutil.copyfile(model_dir / TOKENIZER, partial / TOKENIZER)
        manifest = {"model": MODEL_PACKAGE, **identity, "training_sets": list(TRAINING_SETS),
                    "training_pairs": len(labelled), "mined_negatives": len(mined),
                    "retyped_positives": len(retyped),
                    "opset": OPSET, "torch": torch_version}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

    publish_export(target, write)
    return target, True


def export_graph(model: Any, graph: Path) -> str:
    """``torch.onnx.export`` of the pair classifier (one logit per pair); torch's version.
    The graph's numbers are checked against torch by the score tests."""
    return export_bert(model, graph, "logit", lambda out: out.logits, {0: "batch"},
                       example=(2, 6))
