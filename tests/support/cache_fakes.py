"""An in-memory twin of the embedding model, for cache tests that need no model.

Bag-of-words hashing: texts with the same words get the same unit vector, and
similar texts similar ones, in microseconds and with no torch.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

DIM = 384


def bag_of_words(text: str, dim: int = DIM) -> np.ndarray:
    vector = np.zeros(dim, dtype=np.float32)
    for word in re.findall(r"\w+", text.lower()):
        slot = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big")
        vector[slot % dim] += 1.0
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm else vector


class WordsEmbedder:
    dim = DIM
    ready = True

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def embed(self, text: str) -> np.ndarray:
        self.calls.append(text)
        return bag_of_words(text)

    async def judge(self, question: str, cached: Sequence[str]) -> np.ndarray:
        """The pair judge's twin: the bag-of-words cosine of each pair."""
        return np.array([max(0.0, float(bag_of_words(question) @ bag_of_words(c)))
                         for c in cached], dtype=np.float32)
