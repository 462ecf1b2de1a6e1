"""The semantic cache's shipped judge, held on labelled sets it never trained on.

The pair model ``hedgerow cache export-model`` trains (``gateway.cache.pair_export``,
on ``gateway/cache/training``) is judged here as the sidecar runs it, with the
shipped policy's candidate floor, candidate count and threshold, on:

- sealed2 (336 pairs): the development set ``pair_threshold`` was chosen on;
- sealed3 (768 pairs, 24 domains, 18 negative kinds): frozen in its own
  commit before anything was measured on it, used for no choice.

Each must keep the figures in docs/benchmarks.md ("The pair model ships",
2026-12-04) within about two pairs, stay far above plain MiniLM cosine, and
hold as the cache runs (every question of a set cached in one namespace,
every rewording looked up against all of them). A failure prints counts,
never pairs: neither set's mistakes are read.

``HEDGEROW_BENCH_SWITCH_OFF=pair_model`` judges with the previous design
(cosine 0.68 + guards) instead: the tests here must fail then
(docs/benchmarks.md records that run).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.cache_eval import SEALED2_PATH, SEALED3_PATH, load_pairs
from bench.pair_eval import evaluate
from gateway.cache.embedder import load_minilm
from gateway.cache.pair_export import export_identity, is_current
from gateway.cache.pair_model import load_pair_model, pair_export_dir
from policies.schema import load_policy

# ~1 minute of judging on two cores (both sets, pairwise and as the cache runs).
pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]

SWITCHED_OFF = "pair_model" in os.environ.get("HEDGEROW_BENCH_SWITCH_OFF", "").split(",")
SETTINGS = load_policy().cache.semantic
# Measured 2026-12-04 (bench.pair_eval): sealed3 0.946 / 0.815 (18 false hits of 384
# negatives), sealed2 0.945 / 0.720 (7 of 168); as the cache runs 0.881 / 0.789 and
# 0.887 / 0.702. The bounds sit about two pairs below.
PRECISION_SEALED3, RECALL_SEALED3 = 0.93, 0.79
PRECISION_SEALED2, RECALL_SEALED2 = 0.93, 0.70
RETRIEVAL_PRECISION = 0.86
RETRIEVAL_RECALL = {"sealed2": 0.68, "sealed3": 0.77}


def test_the_judge_measured_is_the_one_the_shipped_training_makes() -> None:
    """A stale export (training pairs or recipe changed since) would be measured
    here instead of what ships: `hedgerow cache export-model` makes it again."""
    assert is_current(pair_export_dir(), export_identity())


@pytest.fixture(scope="module")
def judged() -> dict[str, dict[str, Any]]:
    embedder = load_minilm(threads=2)
    model = load_pair_model(threads=2)
    results = {name: evaluate(load_pairs(path), embedder, model, SETTINGS)
               for name, path in (("sealed2", SEALED2_PATH), ("sealed3", SEALED3_PATH))}
    if SWITCHED_OFF:
        for result in results.values():
            result["shipped"] = result["previous_design_cosine_0.68_guards"]
    return results


def _counts(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: figures[k] for k in ("precision", "recall", "hits", "false_hits")}


def test_on_the_set_used_for_no_choice_the_judge_keeps_its_figures(
        judged: dict[str, dict[str, Any]]) -> None:
    """On data nobody tuned on, far above plain cosine. (Issue 20's target,
    precision >= 0.97 with recall >= 0.6, is not met at the shipped threshold:
    docs/benchmarks.md.)"""
    sealed3 = judged["sealed3"]
    shipped, cosine = sealed3["shipped"], sealed3["baseline_plain_cosine_0.68"]
    assert sealed3["pairs"] >= 700
    assert shipped["precision"] >= PRECISION_SEALED3, _counts(shipped)
    assert shipped["recall"] >= RECALL_SEALED3, _counts(shipped)
    assert shipped["precision"] >= cosine["precision"] + 0.2, (_counts(shipped), _counts(cosine))


def test_on_the_development_set_the_judge_keeps_its_figures(
        judged: dict[str, dict[str, Any]]) -> None:
    shipped = judged["sealed2"]["shipped"]
    assert shipped["precision"] >= PRECISION_SEALED2, _counts(shipped)
    assert shipped["recall"] >= RECALL_SEALED2, _counts(shipped)


@pytest.mark.parametrize("name", ["sealed2", "sealed3"])
def test_as_the_cache_runs_a_question_rarely_hits_another_cached_question(
        judged: dict[str, dict[str, Any]], name: str) -> None:
    found = judged[name]["retrieval"]
    if SWITCHED_OFF:
        pytest.fail("the previous design's retrieval is held in test_cache_accuracy.py")
    assert found["precision"] >= RETRIEVAL_PRECISION, found
    assert found["recall"] >= RETRIEVAL_RECALL[name], found
