"""The semantic cache's shipped judge, held on labelled sets it never trained on.

The pair model ``hedgerow cache export-model`` trains (``gateway.cache.pair_export``,
on ``gateway/cache/training``) is judged here as the sidecar runs it, with the
shipped policy's candidate floor, candidate count and threshold, on:

- sealed2 (336 pairs): the first development set;
- sealed3 (768 pairs, 24 domains, 18 negative kinds): scored once as a
  sealed set, then the development set ``pair_threshold`` (0.98) was chosen
  on by a rule fixed before (commit 3963bde);
- sealed4 (768 pairs, 24 more domains, the same kinds, two authors): frozen
  in its own commit before anything was measured on it, used for no choice.

Each must keep the figures in docs/benchmarks.md ("A threshold for
precision, and a fourth sealed set", 2026-12-04) within about two pairs, stay far above plain MiniLM cosine, and
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

from bench.cache_eval import SEALED2_PATH, SEALED3_PATH, SEALED4_PATH, load_pairs
from bench.pair_eval import evaluate
from gateway.cache.embedder import load_minilm
from gateway.cache.pair_export import export_identity, is_current
from gateway.cache.pair_model import load_pair_model, pair_export_dir
from policies.schema import load_policy

# ~3 minutes of judging on two cores (three sets, pairwise and as the cache runs).
pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]

SWITCHED_OFF = "pair_model" in os.environ.get("HEDGEROW_BENCH_SWITCH_OFF", "").split(",")
SETTINGS = load_policy().cache.semantic
# Measured 2026-12-04 20:41 UTC (bench.pair_eval, pair_threshold 0.98): sealed4
# 0.934 / 0.297 (8 false hits of 384 negatives), sealed3 0.986 / 0.565 (3),
# sealed2 0.937 / 0.441 (5); as the cache runs 0.889 / 0.292, 0.960 / 0.565,
# 0.914 / 0.441. The bounds sit about two pairs below.
BOUNDS = {"sealed4": (0.915, 0.29), "sealed3": (0.975, 0.555), "sealed2": (0.91, 0.425)}
RETRIEVAL_BOUNDS = {"sealed4": (0.87, 0.285), "sealed3": (0.945, 0.555), "sealed2": (0.89, 0.425)}
PATHS = {"sealed2": SEALED2_PATH, "sealed3": SEALED3_PATH, "sealed4": SEALED4_PATH}


def test_the_judge_measured_is_the_one_the_shipped_training_makes() -> None:
    """A stale export (training pairs or recipe changed since) would be measured
    here instead of what ships: `hedgerow cache export-model` makes it again."""
    assert is_current(pair_export_dir(), export_identity())


@pytest.fixture(scope="module")
def judged() -> dict[str, dict[str, Any]]:
    embedder = load_minilm(threads=2)
    model = load_pair_model(threads=2)
    results = {name: evaluate(load_pairs(path), embedder, model, SETTINGS)
               for name, path in PATHS.items()}
    if SWITCHED_OFF:
        for result in results.values():
            result["shipped"] = result["previous_design_cosine_0.68_guards"]
    return results


def _counts(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: figures[k] for k in ("precision", "recall", "hits", "false_hits")}


def test_on_the_set_used_for_no_choice_the_judge_keeps_its_figures(
        judged: dict[str, dict[str, Any]]) -> None:
    """On data nobody tuned on, far above plain cosine. (Issue 20's target,
    precision >= 0.97 with recall >= 0.6, is not met: docs/benchmarks.md.)"""
    sealed4 = judged["sealed4"]
    shipped, cosine = sealed4["shipped"], sealed4["baseline_plain_cosine_0.68"]
    assert sealed4["pairs"] >= 700
    precision, recall = BOUNDS["sealed4"]
    assert shipped["precision"] >= precision, _counts(shipped)
    assert shipped["recall"] >= recall, _counts(shipped)
    assert shipped["precision"] >= cosine["precision"] + 0.3, (_counts(shipped), _counts(cosine))


@pytest.mark.parametrize("name", ["sealed2", "sealed3"])
def test_on_the_development_sets_the_judge_keeps_its_figures(
        judged: dict[str, dict[str, Any]], name: str) -> None:
    shipped = judged[name]["shipped"]
    precision, recall = BOUNDS[name]
    assert shipped["precision"] >= precision, _counts(shipped)
    assert shipped["recall"] >= recall, _counts(shipped)


@pytest.mark.parametrize("name", ["sealed2", "sealed3", "sealed4"])
def test_as_the_cache_runs_a_question_rarely_hits_another_cached_question(
        judged: dict[str, dict[str, Any]], name: str) -> None:
    found = judged[name]["retrieval"]
    if SWITCHED_OFF:
        pytest.fail("the previous design's retrieval is held in test_cache_accuracy.py")
    precision, recall = RETRIEVAL_BOUNDS[name]
    assert found["precision"] >= precision, found
    assert found["recall"] >= recall, found
