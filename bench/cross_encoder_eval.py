"""The semantic cache's pair model, trained on chosen sets and tested on others (torch).

Since 2026-12-04 this design is the cache's judge (``gateway.cache.pair_export``
trains it at install time, ``bench.pair_eval`` measures the shipped export);
this script remains the place to try the same recipe on other splits, e.g.
to see how much each training set adds. What follows is its original case.

The shipped semantic cache compares two questions by the cosine of their
MiniLM embeddings, then the guards (``gateway.cache.guards``). This script
asks whether reading the two questions *together* does better: the bundled
all-MiniLM-L6-v2 weights with a one-logit head, fine-tuned as a pair
classifier (binary cross-entropy; both orders of every pair; 4 epochs, batch
16, lr 3e-5 with 10 % warm-up then linear decay; seed 0, deterministic on
CPU) on the labelled sets named by ``--train``, then scored on the sets named
by ``--test``, which it never saw. A pair's score is the lower of its two
orders' probabilities (a hit must hold both ways, as the cache's reuse does).

For each test set it prints precision and recall along the score threshold
for the cross-encoder alone, with the guards, and with the shipped cosine
(0.68) as a pre-filter -- the three ways it could sit in the cache -- beside
the shipped design (cosine 0.68 + guards) and plain cosine on the same pairs,
and, last, one JSON line with all of it. Individual false hits are not
printed: ``sealed2`` is looked at once per design.

    .venv/bin/python -m bench.cross_encoder_eval --train first,holdout,fresh,sealed --test sealed2

Needs ``hedgerow[export]`` (torch, transformers); ~5-10 minutes on two cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from bench.cache_eval import SETS, Pair, load_pairs, score_pairs
from gateway.cache import pair_export
from gateway.cache.embedder import load_minilm
from gateway.cache.keys import normalize_text
from gateway.cache.pair_export import LabelledPair, Recipe

THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99)
SHIPPED_COSINE = 0.68


def train(pairs: Sequence[Pair], *, epochs: int = 4, seed: int = 0) -> Any:
    """The shipped recipe (``gateway.cache.pair_export.train``), on ``pairs``."""
    return pair_export.train([LabelledPair(p.a, p.b, p.label) for p in pairs],
                             Recipe(epochs=epochs, seed=seed))


def pair_scores(model: Any, tokenizer: Any, pairs: Sequence[Pair]) -> np.ndarray:
    import torch

    scores = []
    with torch.no_grad():
        for i in range(0, len(pairs), 64):
            chunk = [(normalize_text(p.a), normalize_text(p.b)) for p in pairs[i:i + 64]]
            both = []
            for first, second in ((0, 1), (1, 0)):
                encoded = tokenizer([c[first] for c in chunk], [c[second] for c in chunk],
                                    padding=True, truncation=True, max_length=128,
                                    return_tensors="pt")
                both.append(torch.sigmoid(model(**encoded).logits.squeeze(-1)).numpy())
            scores.extend(np.minimum(both[0], both[1]).tolist())
    return np.array(scores)


def precision_recall(hit: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    true_hits = int((hit & (labels == 1)).sum())
    false_hits = int((hit & (labels == 0)).sum())
    return {"precision": round(true_hits / (true_hits + false_hits), 4) if hit.any() else 1.0,
            "recall": round(true_hits / int((labels == 1).sum()), 4), "false_hits": false_hits}


def evaluate(pairs: Sequence[Pair], scores: np.ndarray, cosine: np.ndarray,
             guards_pass: np.ndarray) -> dict[str, Any]:
    labels = np.array([p.label for p in pairs])
    ways = {"cross_encoder": np.ones(len(pairs), dtype=bool),
            "cross_encoder+guards": guards_pass,
            f"cosine>={SHIPPED_COSINE}+cross_encoder": cosine >= SHIPPED_COSINE}
    return {
        "pairs": len(pairs),
        "shipped (cosine 0.68 + guards)": precision_recall(
            (cosine >= SHIPPED_COSINE) & guards_pass, labels),
        "baseline (plain cosine 0.68)": precision_recall(cosine >= SHIPPED_COSINE, labels),
        **{way: [{"threshold": t, **precision_recall((scores >= t) & mask, labels)}
                 for t in THRESHOLDS] for way, mask in ways.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", default="first,holdout,fresh,sealed,pairs_train")
    parser.add_argument("--test", default="sealed2")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    trained_on = args.train.split(",")
    tested_on = args.test.split(",")
    if set(trained_on) & set(tested_on):
        parser.error("a set cannot be both trained and tested on")
    model, tokenizer = train([p for name in trained_on for p in load_pairs(SETS[name])],
                             epochs=args.epochs, seed=args.seed)
    embedder = load_minilm(threads=1)
    results: dict[str, Any] = {}
    scoring_ms_per_pair = {}
    for name in tested_on:
        pairs = load_pairs(SETS[name])
        scored = score_pairs(pairs, embedder)
        started = time.perf_counter()
        scores = pair_scores(model, tokenizer, pairs)
        scoring_ms_per_pair[name] = round((time.perf_counter() - started) * 1000 / len(pairs), 2)
        results[name] = evaluate(pairs, scores,
                                 np.array([s.score for s in scored]),
                                 np.array([s.guard is None for s in scored]))
        for way, figures in results[name].items():
            if isinstance(figures, list):
                print(f"{name} {way}: " + "  ".join(
                    f"{f['threshold']}: {f['precision']:.3f}/{f['recall']:.3f}" for f in figures),
                    file=sys.stderr)
            elif isinstance(figures, dict):
                print(f"{name} {way}: {figures['precision']:.3f}/{figures['recall']:.3f}",
                      file=sys.stderr)
    print(orjson.dumps({"trained_on": trained_on, "tested_on": tested_on,
                        "epochs": args.epochs, "seed": args.seed, "sets": results,
                        "scoring_ms_per_pair_both_orders_torch_batched": scoring_ms_per_pair,
                        "load_avg_1m": round(os.getloadavg()[0], 2)}).decode())


if __name__ == "__main__":
    main()
