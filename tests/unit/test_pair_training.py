"""The pair model's training data: mined negatives and the export's identity
(no torch: the training itself runs in `hedgerow cache export-model`, and the
exported model is measured in tests/bench/test_pair_judge_accuracy.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gateway.cache import pair_export
from gateway.cache.hard_negatives import mine
from gateway.cache.pair_export import (
    LabelledPair,
    Recipe,
    mined_negatives,
    training_sha256,
    typing_positives,
)


def unit(*values: float) -> np.ndarray:
    vector = np.array(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def test_each_question_gets_its_nearest_unlinked_neighbour_as_a_negative() -> None:
    pairs = [LabelledPair("how do i bake bread", "bread baking steps", 1),
             LabelledPair("how do i bake cake", "how do i bake pie", 0)]
    vectors = {  # bread's paraphrase is nearest to it (0.99), then cake (0.6)
        "how do i bake bread": unit(1, 0, 0),
        "bread baking steps": unit(0.99, 0.14, 0),
        "how do i bake cake": unit(0.6, 0.8, 0),  # nearest to it: the steps (0.70)
        "how do i bake pie": unit(0, 0.8, 0.6),  # nearest to it: cake (0.64)
    }
    found = mined_negatives(pairs, vectors, Recipe())
    assert all(m.label == 0 for m in found)
    # Never the labelled paraphrase; each question's nearest other, once per couple.
    assert {frozenset((m.a, m.b)) for m in found} == {
        frozenset(("how do i bake bread", "how do i bake cake")),
        frozenset(("bread baking steps", "how do i bake cake")),
        frozenset(("how do i bake cake", "how do i bake pie"))} and len(found) == 3


def test_neighbours_beyond_the_floor_or_the_ceiling_are_not_mined() -> None:
    pairs = [LabelledPair("a", "b", 0)]
    far = {"a": unit(1, 0), "b": unit(0, 1)}  # cosine 0: an unrelated question
    assert mined_negatives(pairs, far, Recipe(mined_floor=0.3)) == []
    twins = {"a": unit(1, 0), "b": unit(1, 0.01)}  # cosine ~1: likely an unlabelled paraphrase
    assert mined_negatives(pairs, twins, Recipe(mined_ceiling=0.85)) == []


def test_the_export_is_named_by_its_training_pairs(tmp_path: Path) -> None:
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    one.write_text('{"a": "x", "b": "y", "label": 1}\n')
    two.write_text('{"a": "x", "b": "y", "label": 0}\n')
    assert training_sha256([one]) != training_sha256([two])
    assert all(path.is_file() for path in pair_export.training_files())
    assert len(pair_export.read_pairs(pair_export.training_files())) >= 2000


def test_retyped_positives_are_the_same_question_typed_otherwise() -> None:
    pairs = [LabelledPair(f"How do I bake loaf number {i}?", f"loaf {i} baking steps", 1)
             for i in range(200)]
    retyped = typing_positives(pairs, every=4)
    # About one text in four, each paired with one retyping of itself, as a paraphrase.
    assert 60 <= len(retyped) <= 140
    assert all(r.label == 1 and r.a != r.b for r in retyped)
    texts = {t for p in pairs for t in (p.a, p.b)}
    assert {r.a for r in retyped} <= texts and not {r.b for r in retyped} & texts
    # Every retyping keeps the question's own words (its first capital may drop).
    for r in retyped:
        core = r.a.rstrip("?")
        assert core in r.b or (core[:1].lower() + core[1:]) in r.b
    assert typing_positives(pairs, every=4) == retyped  # deterministic
    assert typing_positives(pairs, every=0) == []


def test_hard_negatives_are_the_judges_unlabelled_hits_among_the_cache_candidates() -> None:
    pairs = [LabelledPair("bake bread", "steps to bake bread", 1),
             LabelledPair("bake cake", "bake pie", 0)]
    vectors = {"bake bread": unit(1, 0, 0), "steps to bake bread": unit(0.99, 0.14, 0),
               "bake cake": unit(0.9, 0.43, 0), "bake pie": unit(0.8, 0, 0.6)}
    judged: list[tuple[str, str]] = []

    def judge(chosen: Sequence[tuple[str, str]]) -> np.ndarray:
        judged.extend(chosen)
        return np.array([0.9 if "cake" in a + b and "bread" in a + b else 0.1
                         for a, b in chosen])

    found = mine(pairs, vectors, judge, max_candidates=2, candidate_floor=0.3)
    # Never the labelled paraphrase nor the labelled negative; each couple judged once.
    assert all(frozenset(c) not in ({"bake bread", "steps to bake bread"}, {"bake cake", "bake pie"})
               for c in judged)
    assert len({frozenset(c) for c in judged}) == len(judged)
    # What the judge accepts is mined; what it refuses is not.
    assert {frozenset((a, b)) for a, b, _ in found} == {
        frozenset(("bake bread", "bake cake")), frozenset(("steps to bake bread", "bake cake"))}
    assert all(score == 0.9 for _, _, score in found)
    # Outside a question's max_candidates nearest, or below the floor, nothing is judged.
    judged.clear()
    assert mine(pairs, vectors, judge, max_candidates=1, candidate_floor=0.999) == []
    assert judged == []


def test_mining_skips_labelled_negatives_and_paraphrases_joined_through_another() -> None:
    # a~b and b~c are labelled paraphrases, so a and c are one question; a-d is a
    # labelled negative. All four sit within each other's two nearest.
    pairs = [LabelledPair("a", "b", 1), LabelledPair("b", "c", 1), LabelledPair("a", "d", 0)]
    vectors = {"a": unit(1, 0), "b": unit(1, 0.1), "c": unit(1, 0.2), "d": unit(1, 0.3)}
    judged: list[frozenset[str]] = []

    def judge(chosen: Sequence[tuple[str, str]]) -> np.ndarray:
        judged.extend(frozenset(c) for c in chosen)
        return np.ones(len(chosen))

    found = mine(pairs, vectors, judge, max_candidates=3, candidate_floor=0.0)
    assert frozenset("ac") not in judged and frozenset("ad") not in judged
    assert {frozenset((a, b)) for a, b, _ in found} == {frozenset("bd"), frozenset("cd")}
    # Only a question's max_candidates nearest are read: x's nearest is y, z's is y.
    pairs = [LabelledPair(t, f"{t} elsewhere", 1) for t in "xyz"]
    near = {"x": unit(1, 0, 0), "y": unit(1, 0.1, 0), "z": unit(1, 0.5, 0)}
    near |= {f"{t} elsewhere": unit(0, 0, 1) for t in "xyz"}
    for count, xz_read in ((1, False), (2, True)):
        judged.clear()
        mine(pairs, near, judge, max_candidates=count, candidate_floor=0.5)
        assert (frozenset("xz") in judged) is xz_read, count
