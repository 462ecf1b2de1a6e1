"""How often the semantic judge recognises a question typed a little differently.

Labelled sets reword; users also retype. This takes the cached side of a
labelled set's pairs (300 questions) and makes variants a person would read
as the same question -- all lower case without the closing mark (which can
change meaning where case inside the text is meaning, "MB" vs "Mb": rare in
these sets), the first word followed by a comma, " please" added -- and reports the share the judge
as the cache runs it would hit at the shipped ``pair_threshold`` (the
same-wording rule first, ``gateway.cache.semantic.typing_key``, then the pair
model), and the model's median score. Counts only.

    .venv/bin/python -m bench.typing_variants [--sets sealed4,first]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import orjson

from bench.cache_eval import SETS, load_pairs
from gateway.cache.pair_model import judge_many, load_pair_model
from gateway.cache.semantic import typed_alike
from policies.schema import load_policy

VARIANTS: dict[str, Callable[[str], str]] = {
    "lower_case_no_mark": lambda q: re.sub(r"[?.!]+$", "", q).lower(),
    "comma_after_first_word": lambda q: q.replace(" ", ", ", 1),
    "please_added": lambda q: re.sub(r"[?.!]*$", "", q) + " please?",
}
QUESTIONS = 300


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="sealed4,first")
    parser.add_argument("--pair-model", type=Path, default=None,
                        help="an export directory other than this machine's (to compare judges)")
    parser.add_argument("--pair-threshold", type=float, default=None,
                        help="instead of the shipped policy's")
    args = parser.parse_args(argv)
    threshold = args.pair_threshold
    if threshold is None:
        threshold = load_policy().cache.semantic.pair_threshold
    model = load_pair_model(threads=1, directory=args.pair_model)
    results: dict[str, dict[str, object]] = {}
    for name in args.sets.split(","):
        questions = sorted({p.a for p in load_pairs(SETS[name])})[:QUESTIONS]
        results[name] = {}
        for kind, vary in VARIANTS.items():
            pairs = [(vary(q), q) for q in questions]
            scores = judge_many(model, pairs)
            same = np.array([typed_alike(a, b) for a, b in pairs])
            hit = same | (scores >= threshold)
            results[name][kind] = {"questions": len(pairs), "found": round(float(hit.mean()), 3),
                                   "found_by_model_alone": round(float((scores >= threshold).mean()), 3),
                                   "model_median": round(float(np.median(scores)), 3)}
    print(orjson.dumps({"pair_threshold": threshold, "sets": results}).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
