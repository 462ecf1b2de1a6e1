"""The semantic cache's precision claims, held on the frozen sets.

bench/data/paraphrases_holdout.jsonl was written and committed before any
guard or threshold was tuned; its test half (7 of 14 domains) was used for no
choice before 2026-12-02. paraphrases_fresh.jsonl and paraphrases_sealed.jsonl
were written by authors that never saw the guards; the question-form rules of
2026-12-02 were written after one look at fresh's false hits (so fresh is
development data now), and sealed was looked at once, after they were fixed.
With the real MiniLM and the shipped threshold, the cache must keep the
figures measured in docs/benchmarks.md within a pair or two (holdout 0.951 /
0.731, test half 0.923 / 0.766, first set 1.000 / 0.679, fresh 0.856 / 0.458,
**sealed 0.574 / 0.369**, sealed2 0.780 / 0.423 (counts only); as the cache runs, every question looked up against
every cached one: holdout 0.925 / 0.731), and stay above plain cosine (0.553
precision on the holdout, 0.470 on sealed, at the same threshold): a guard
switched off, a looser threshold or a check that refuses everything fails
here. The sealed figure is the one that says what a user would see on
questions nobody tuned for, and why the semantic part is off by default.

``HEDGEROW_BENCH_SWITCH_OFF=asking`` switches the question-form check
(``gateway.cache.asking``) off, ``wording`` the content-word check: either
must make a test here fail (docs/benchmarks.md records the runs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from bench.cache_eval import (
    FRESH_PATH,
    HOLDOUT_PATH,
    PAIRS_PATH,
    SEALED2_PATH,
    SEALED_PATH,
    Scored,
    load_pairs,
    measure,
    retrieval,
    score_pairs,
    split_by_domain,
    weakest_alignment,
)
from gateway.cache import asking, wording
from gateway.cache.embedder import load_minilm
from policies.schema import load_policy

pytestmark = pytest.mark.bench

SWITCHED_OFF = set(filter(None, os.environ.get("HEDGEROW_BENCH_SWITCH_OFF", "").split(",")))
THRESHOLD = load_policy().cache.semantic.threshold


@pytest.fixture(scope="module")
def switched() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        if "asking" in SWITCHED_OFF:
            patch.setattr(asking, "differs", lambda new, cached: None)
        if "wording" in SWITCHED_OFF:
            patch.setattr(wording, "changed", lambda new, cached: None)
        yield


@pytest.fixture(scope="module")
def model(switched: None) -> Any:
    return load_minilm(threads=1)


@pytest.fixture(scope="module")
def holdout(model: Any) -> list[Scored]:
    return score_pairs(load_pairs(HOLDOUT_PATH), model)  # one encode call


def test_cache_precision_on_the_frozen_holdout_at_the_shipped_threshold(
        holdout: list[Scored]) -> None:
    cache = measure(holdout, THRESHOLD)
    baseline = measure(holdout, THRESHOLD, use_guards=False)
    assert cache["precision"] >= 0.93, cache["false_hits"]
    assert cache["recall"] >= 0.70
    assert cache["precision"] >= baseline["precision"] + 0.3


def test_cache_precision_on_the_never_tuned_half(holdout: list[Scored]) -> None:
    _, test = split_by_domain([s.pair for s in holdout])
    assert len(test) >= 150
    chosen = {id(p) for p in test}
    cache = measure([s for s in holdout if id(s.pair) in chosen], THRESHOLD)
    assert cache["precision"] >= 0.90, cache["false_hits"]
    assert cache["recall"] >= 0.72


def test_cache_precision_on_the_first_set(model: Any) -> None:
    cache = measure(score_pairs(load_pairs(PAIRS_PATH), model), THRESHOLD)
    assert cache["precision"] >= 0.98, cache["false_hits"]
    assert cache["recall"] >= 0.64


def test_as_the_cache_runs_a_question_rarely_hits_another_cached_question(model: Any) -> None:
    """Every holdout question cached in one namespace, every rewording looked
    up against all of them: a hit on any wrong one counts."""
    found = retrieval(load_pairs(HOLDOUT_PATH), model, THRESHOLD)
    assert found["precision"] >= 0.90, found["wrong"]
    assert found["recall"] >= 0.70


def test_cache_precision_on_the_third_set_written_without_seeing_the_guards(model: Any) -> None:
    scored = score_pairs(load_pairs(FRESH_PATH), model)
    cache = measure(scored, THRESHOLD)
    baseline = measure(scored, THRESHOLD, use_guards=False)
    assert cache["precision"] >= 0.82, cache["false_hits"]
    assert cache["recall"] >= 0.42
    assert cache["precision"] >= baseline["precision"] + 0.3


def test_cache_precision_on_the_sealed_set_looked_at_once(model: Any) -> None:
    """Twelve domains and fourteen negative kinds nobody tuned for: the guards
    still buy precision over plain cosine, but far less than on the other sets."""
    scored = score_pairs(load_pairs(SEALED_PATH), model)
    cache = measure(scored, THRESHOLD)
    baseline = measure(scored, THRESHOLD, use_guards=False)
    assert len(scored) >= 300
    assert cache["precision"] >= 0.53, cache["false_hits"]
    assert cache["recall"] >= 0.33
    assert cache["precision"] >= baseline["precision"] + 0.05


def test_cache_precision_on_the_second_sealed_set_with_counts_only(model: Any) -> None:
    """Twelve more domains, frozen before any measurement (2026-12-03: 0.780 /
    0.423; plain cosine 0.494 / 0.756). A failure shows counts, never the
    pairs: their false hits are not read, so the set stays unseen."""
    scored = score_pairs(load_pairs(SEALED2_PATH), model)
    cache = measure(scored, THRESHOLD)
    baseline = measure(scored, THRESHOLD, use_guards=False)
    counts = {"hits": cache["hits"], "false_hits": len(cache["false_hits"])}
    assert len(scored) >= 300
    assert cache["precision"] >= 0.74, counts
    assert cache["recall"] >= 0.38, counts
    assert cache["precision"] >= baseline["precision"] + 0.2, counts


def test_word_alignment_scores_the_same_words_one_and_a_substitution_less(model: Any) -> None:
    """The measurement behind dropping token alignment (docs/benchmarks.md, candidate 1)."""
    assert weakest_alignment(model, "who wrote hamlet", "who wrote Hamlet?") == 1.0
    swapped = weakest_alignment(model, "is the 7 pm train crowded", "is the 7 am train crowded")
    assert 0.0 < swapped < 1.0
