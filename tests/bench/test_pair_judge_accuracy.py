"""The semantic cache's shipped judge, held on labelled sets it never trained on.

The pair model ``hedgerow cache export-model`` trains (``gateway.cache.pair_export``,
on ``gateway/cache/training``) is judged here as the sidecar runs it, with the
shipped policy's candidate floor, candidate count and threshold, on:

- sealed4 (768 pairs, 24 domains, 18 negative kinds, two authors asked for
  far rewordings): scored once as a sealed set against the previous judge,
  then the development set ``pair_threshold`` was chosen on, by a rule
  committed first (712de94: the highest recall as the cache runs with
  precision >= 0.97 there, which gave 0.99);
- sealed5 (768 pairs, 24 more domains, the same kinds, two more authors):
  frozen in its own commit (fa9e177) before anything was measured on it,
  used for no choice;
- sealed6 (768 pairs, 24 more domains, three more authors, each domain's
  pairs asking different things): frozen in its own commit (d04e922), used
  for no choice.

Each must keep the figures in docs/benchmarks.md ("Negatives as the cache
meets them", 2026-12-05, its "What happened" after candidate E) within two
pairs, at the shipped point and at 0.95 and 0.5 along the curve, stay
far above plain MiniLM cosine, and hold as the cache runs (every question of
a set cached in one namespace, every rewording looked up against all of
them). A failure prints counts, never pairs: neither set's mistakes are read.

``HEDGEROW_BENCH_SWITCH_OFF=pair_model`` judges with the previous design
(cosine 0.68 + guards) instead: the tests here must fail then
(docs/benchmarks.md records that run).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.cache_eval import SEALED4_PATH, SEALED5_PATH, SEALED6_PATH, load_pairs
from bench.pair_eval import evaluate
from gateway.cache.embedder import load_minilm
from gateway.cache.pair_export import export_identity, is_current
from gateway.cache.pair_model import load_pair_model, pair_export_dir
from policies.schema import load_policy

# ~3 minutes of judging on two cores (three sets, pairwise and as the cache runs).
pytestmark = [pytest.mark.bench, pytest.mark.timeout(600)]

SWITCHED_OFF = "pair_model" in os.environ.get("HEDGEROW_BENCH_SWITCH_OFF", "").split(",")
SETTINGS = load_policy().cache.semantic
# Measured 2026-12-05 17:34 UTC (bench.pair_eval, pair_threshold 0.99, chosen on
# sealed4 by the rule of 712de94): pair by pair sealed5 1.000 / 0.333 (0 false hits
# of 384 negatives), sealed4 0.990 / 0.268 (1), sealed6 1.000 / 0.385 (0); as the
# cache runs 0.985 / 0.333, 0.981 / 0.263, 0.993 / 0.383. The bounds sit two pairs
# below (two more wrong hits, two fewer found).
BOUNDS = {"sealed5": (0.98, 0.328), "sealed4": (0.97, 0.263), "sealed6": (0.98, 0.380)}
RETRIEVAL_BOUNDS = {"sealed5": (0.965, 0.328), "sealed4": (0.96, 0.257), "sealed6": (0.975, 0.377)}
# As the cache runs, an operator who lowers pair_threshold to 0.95 buys recall
# with precision (2026-12-05 09:47 UTC: sealed5 0.973 / 0.464, sealed4 0.957 / 0.404;
# sealed6 0.985 / 0.516): held too, so the curve below the shipped point keeps its shape.
# And at 0.5, the point that shipped until 2026-12-05 evening and that README and
# default.yaml quote (sealed5 0.877 / 0.612, sealed4 0.808 / 0.602, sealed6 0.927 / 0.659).
CURVE_BOUNDS = {
    0.95: {"sealed5": (0.96, 0.45), "sealed4": (0.945, 0.39), "sealed6": (0.975, 0.51)},
    0.5: {"sealed5": (0.865, 0.605), "sealed4": (0.795, 0.595), "sealed6": (0.92, 0.653)},
}
PATHS = {"sealed4": SEALED4_PATH, "sealed5": SEALED5_PATH, "sealed6": SEALED6_PATH}


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


@pytest.mark.parametrize("name", ["sealed5", "sealed6"])
def test_on_the_sets_used_for_no_choice_the_judge_keeps_its_figures(
        judged: dict[str, dict[str, Any]], name: str) -> None:
    """On data nobody tuned on, far above plain cosine."""
    sealed = judged[name]
    shipped, cosine = sealed["shipped"], sealed["baseline_plain_cosine_0.68"]
    assert sealed["pairs"] >= 700
    precision, recall = BOUNDS[name]
    assert shipped["precision"] >= precision, _counts(shipped)
    assert shipped["recall"] >= recall, _counts(shipped)
    assert shipped["precision"] >= cosine["precision"] + 0.3, (_counts(shipped), _counts(cosine))


def test_on_the_development_set_the_judge_keeps_its_figures(
        judged: dict[str, dict[str, Any]]) -> None:
    shipped = judged["sealed4"]["shipped"]
    precision, recall = BOUNDS["sealed4"]
    assert shipped["precision"] >= precision, _counts(shipped)
    assert shipped["recall"] >= recall, _counts(shipped)


@pytest.mark.parametrize("name", ["sealed4", "sealed5", "sealed6"])
def test_as_the_cache_runs_a_question_rarely_hits_another_cached_question(
        judged: dict[str, dict[str, Any]], name: str) -> None:
    found = judged[name]["retrieval"]
    if SWITCHED_OFF:
        pytest.fail("the previous design's retrieval is held in test_cache_accuracy.py")
    precision, recall = RETRIEVAL_BOUNDS[name]
    assert found["precision"] >= precision, found
    assert found["recall"] >= recall, found
    curve = {point["threshold"]: point for point in found["curve"]}
    shipped = curve[SETTINGS.pair_threshold]
    assert (shipped["precision"], shipped["recall"]) == (found["precision"], found["recall"])
    for threshold, bounds in CURVE_BOUNDS.items():
        point_precision, point_recall = bounds[name]
        assert curve[threshold]["precision"] >= point_precision, curve[threshold]
        assert curve[threshold]["recall"] >= point_recall, curve[threshold]
