"""What the embedding sidecar costs per embed, side by side with in-process encoding.

    python -m bench.embed_overhead [--sentences 200] [--rounds 1]

One short sentence at a time (the semantic cache's request path: one lookup,
nothing to batch with), the three ways in turn for each sentence so that the
machine's noise falls on all of them alike: ``encode`` called directly,
``MiniLmEmbedder.embed`` (the in-process actor: a thread hop per batch) and
``SidecarEmbedder.embed`` (a Unix-socket round trip to the child process).
Prints one JSON line of p50/p99 in ms, and the sidecar's overhead over each.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio
import numpy as np

from gateway.cache.embed_sidecar import SidecarEmbedder
from gateway.cache.embedder import MiniLmEmbedder, encode, load_minilm

SUBJECTS = ["the weather", "a train ticket", "TCP slow start", "the capital of France",
            "5 km in miles", "a cake recipe", "Python decorators", "the moon landing"]


def sentences(n: int) -> list[str]:
    return [f"Tell me about {SUBJECTS[i % len(SUBJECTS)]}, question {i}." for i in range(n)]


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3)}


async def measure(texts: list[str], rounds: int) -> dict[str, Any]:
    model = load_minilm(threads=1)
    encode(model, ["warm up"])
    local = MiniLmEmbedder(model=model, threads=1)
    sidecar = SidecarEmbedder(threads=1)
    times: dict[str, list[float]] = {"encode": [], "in_process": [], "sidecar": []}
    async with anyio.create_task_group() as tg:
        await tg.start(local.run)
        await tg.start(sidecar.run)
        for _ in range(rounds):
            for text in texts:
                started = time.perf_counter()
                encode(model, [text])
                times["encode"].append(time.perf_counter() - started)
                for name, embedder in (("in_process", local), ("sidecar", sidecar)):
                    started = time.perf_counter()
                    await embedder.embed(text)
                    times[name].append(time.perf_counter() - started)
        tg.cancel_scope.cancel()
    result: dict[str, Any] = {name: percentiles(t) for name, t in times.items()}
    for base in ("encode", "in_process"):
        result[f"sidecar_minus_{base}"] = {
            key: round(result["sidecar"][key] - result[base][key], 3) for key in ("p50_ms", "p99_ms")}
    result["samples"] = len(times["sidecar"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.embed_overhead")
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(anyio.run(measure, sentences(args.sentences), args.rounds)))


if __name__ == "__main__":
    main()
