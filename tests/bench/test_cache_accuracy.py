"""The semantic cache's precision claim, held on the frozen holdout set.

bench/data/paraphrases_holdout.jsonl was written and committed before any
guard or threshold was tuned; its test half (7 of 14 domains) was never used
to choose anything. With the real MiniLM and the shipped threshold, the cache
must keep the precision and recall measured in docs/benchmarks.md (holdout
0.913 / 0.505, test half 0.870 / 0.500) within a few pairs, and stay far above
plain cosine (0.613 precision on the holdout at the same threshold): a guard
switched off, a looser threshold or a check that refuses everything fails here.
"""

from __future__ import annotations

import pytest

from bench.cache_eval import HOLDOUT_PATH, Scored, load_pairs, measure, score_pairs, split_by_domain
from gateway.cache.embedder import load_minilm
from policies.schema import load_policy


@pytest.fixture(scope="module")
def scored() -> list[Scored]:
    return score_pairs(load_pairs(HOLDOUT_PATH), load_minilm(threads=1))  # one encode call


def test_cache_precision_on_the_frozen_holdout_at_the_shipped_threshold(
        scored: list[Scored]) -> None:
    threshold = load_policy().cache.semantic.threshold
    cache = measure(scored, threshold)
    baseline = measure(scored, threshold, use_guards=False)
    assert cache["precision"] >= 0.88, cache["false_hits"]
    assert cache["recall"] >= 0.45
    assert cache["precision"] >= baseline["precision"] + 0.2


def test_cache_precision_on_the_never_tuned_half(scored: list[Scored]) -> None:
    _, test = split_by_domain([s.pair for s in scored])
    assert len(test) >= 150
    chosen = {id(p) for p in test}
    cache = measure([s for s in scored if id(s.pair) in chosen],
                    load_policy().cache.semantic.threshold)
    assert cache["precision"] >= 0.84, cache["false_hits"]
    assert cache["recall"] >= 0.45
