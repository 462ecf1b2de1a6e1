"""Semantic cache precision and recall on a labeled paraphrase set.

Each pair in ``bench/data/paraphrases.jsonl`` is a cached question ``a`` and
a new question ``b``; ``label`` 1 means ``a``'s answer is right for ``b``
(a true paraphrase), 0 a hard negative (changed number, negation, swapped or
different entity, different unit, different code identifier). A pair counts
as a hit when the real embedder's cosine similarity reaches the threshold and
the guards pass, exactly as ``SemanticIndex.search`` decides.

    python -m bench.cache_eval [--threshold T] [--sweep]

prints per-kind results and, last, one JSON line with ``semantic_precision``
and ``semantic_recall`` (and the same without guards, for comparison).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gateway.cache import guards
from gateway.cache.embedder import encode, load_minilm
from gateway.cache.keys import normalize_text
from policies.schema import load_policy

PAIRS_PATH = Path(__file__).with_name("data") / "paraphrases.jsonl"


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    label: int
    kind: str


@dataclass(frozen=True)
class Scored:
    pair: Pair
    score: float
    guard: str | None  # the guard that refused, None if they agree


def load_pairs(path: Path = PAIRS_PATH) -> list[Pair]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [Pair(r["a"], r["b"], int(r["label"]), r["kind"]) for r in rows]


def score_pairs(pairs: Sequence[Pair], model: Any = None) -> list[Scored]:
    """Cosine similarity of each pair (as the cache normalizes text) and the guards' verdict."""
    model = model if model is not None else load_minilm(threads=1)
    a = encode(model, [normalize_text(p.a) for p in pairs])
    b = encode(model, [normalize_text(p.b) for p in pairs])
    scores = np.sum(a * b, axis=1)
    return [Scored(p, float(s), guards.check(normalize_text(p.b), normalize_text(p.a)))
            for p, s in zip(pairs, scores)]


def measure(scored: Sequence[Scored], threshold: float, *, use_guards: bool = True) -> dict[str, Any]:
    hits = [s for s in scored if s.score >= threshold and (not use_guards or s.guard is None)]
    true_hits = sum(1 for s in hits if s.pair.label == 1)
    positives = sum(1 for s in scored if s.pair.label == 1)
    return {
        "precision": round(true_hits / len(hits), 4) if hits else 1.0,
        "recall": round(true_hits / positives, 4) if positives else 0.0,
        "hits": len(hits),
        "false_hits": [(s.pair.a, s.pair.b, round(s.score, 3)) for s in hits if s.pair.label == 0],
    }


def report(scored: Sequence[Scored], threshold: float) -> dict[str, Any]:
    guarded = measure(scored, threshold)
    bare = measure(scored, threshold, use_guards=False)
    return {
        "pairs": len(scored),
        "paraphrases": sum(1 for s in scored if s.pair.label == 1),
        "hard_negatives": sum(1 for s in scored if s.pair.label == 0),
        "threshold": threshold,
        "semantic_precision": guarded["precision"],
        "semantic_recall": guarded["recall"],
        "unguarded_precision": bare["precision"],
        "unguarded_recall": bare["recall"],
        "false_hits": guarded["false_hits"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threshold", type=float, default=None,
                        help="default: the shipped policy's cache.semantic.threshold")
    parser.add_argument("--sweep", action="store_true", help="also print a threshold sweep")
    parser.add_argument("--pairs", type=Path, default=PAIRS_PATH)
    args = parser.parse_args(argv)
    threshold = args.threshold or load_policy().cache.semantic.threshold
    pairs = load_pairs(args.pairs)
    started = time.perf_counter()
    scored = score_pairs(pairs)
    elapsed = time.perf_counter() - started
    for kind in sorted({p.kind for p in pairs}):
        subset = [s for s in scored if s.pair.kind == kind]
        hits = sum(1 for s in subset if s.score >= threshold and s.guard is None)
        above = sum(1 for s in subset if s.score >= threshold)
        print(f"{kind:12} pairs={len(subset):3} above_threshold={above:3} hits={hits:3}",
              file=sys.stderr)
    if args.sweep:
        for t in np.arange(0.60, 0.96, 0.025):
            g, b = measure(scored, float(t)), measure(scored, float(t), use_guards=False)
            print(f"t={t:.3f} guarded P={g['precision']:.3f} R={g['recall']:.3f}   "
                  f"unguarded P={b['precision']:.3f} R={b['recall']:.3f}", file=sys.stderr)
    result = report(scored, threshold)
    result["embed_ms_per_sentence"] = round(elapsed * 1000 / (2 * len(pairs)), 2)
    print(orjson.dumps(result).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
