"""Latency of the response cache library itself (no HTTP): embed, hits, misses.

    python -m bench.cache_latency [--redis redis://127.0.0.1:6379/0] [--n 200]

Measures, with the real all-MiniLM-L6-v2 embedder, ``ResponseCache.lookup``
for an exact hit (in-process), an exact hit served from Redis (a second
gateway's memory is empty), a semantic hit and a miss, plus one embedding
alone, with the shipped policy's cache settings and its semantic part turned
on (it ships off). Prints one JSON line of p50/p99 milliseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import orjson

from bench.shipped_policy import SEMANTIC_ON, shipped_policy
from bench.stats import percentile
from gateway.cache import ResponseCache
from gateway.cache.entry import CacheEntry

ANSWER = CacheEntry("git rm the submodule's path, then commit.", "stop", 20, 9, "m", 1)
CACHED = "How do I remove a git submodule?"
# The shipped judge scores it 0.998 against CACHED (the shipped pair_threshold is 0.99).
PARAPHRASE = "What's the way to delete a git submodule?"


def chat(question: str) -> dict[str, Any]:
    return {"model": "smollm2", "temperature": 0,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": question}]}


async def timed(n: int, call: Callable[[int], Awaitable[Any]]) -> dict[str, Any]:
    """p50/p99 of ``n`` calls, and how each lookup was answered (``kinds``: exact,
    semantic, or miss), so a "hit" timing that missed shows."""
    samples = []
    kinds: dict[str, int] = {}
    for i in range(n):
        started = time.perf_counter()
        got = await call(i)
        samples.append(time.perf_counter() - started)
        kind = getattr(got, "kind", None) or ("miss" if got is None else "vector")
        kinds[kind] = kinds.get(kind, 0) + 1
    samples.sort()
    return {"p50_ms": round(percentile(samples, 50) * 1000, 3),
            "p99_ms": round(percentile(samples, 99) * 1000, 3), "kinds": kinds}


async def measure(n: int, redis_url: str | None) -> dict[str, Any]:
    policy = shipped_policy(SEMANTIC_ON)
    cache = ResponseCache(policy, redis_url)
    other = ResponseCache(policy, redis_url) if redis_url else None
    result: dict[str, Any] = {"n": n, "redis": bool(redis_url)}
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        if not await cache.ready(300):
            raise SystemExit("the embedding model did not load")
        await cache.store("local", None, chat(CACHED), ANSWER)
        result["embed"] = await timed(n, lambda i: cache.embedder.embed(f"How far is {i} km?"))
        result["exact_hit"] = await timed(
            n, lambda i: cache.lookup("local", None, chat(CACHED), {}))
        result["semantic_hit"] = await timed(
            n, lambda i: cache.lookup("local", None, chat(PARAPHRASE), {}))
        result["miss"] = await timed(
            n, lambda i: cache.lookup("local", None, chat(f"Who painted ceiling {i}?"), {}))
        if other is not None:
            async def remote_hit(i: int) -> Any:
                other.exact.local.lru.purge_all()
                return await other.lookup("local", None, chat(CACHED), {})

            result["exact_hit_from_redis"] = await timed(n, remote_hit)
        result["stats"] = cache.stats()
        tg.cancel_scope.cancel()
    await cache.aclose()
    if other is not None:
        await other.aclose()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--redis", default=None)
    args = parser.parse_args(argv)
    print(orjson.dumps(anyio.run(measure, args.n, args.redis)).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
