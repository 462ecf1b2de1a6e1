"""What a grammar costs per token on the llama.cpp worker's backend (one slot, real model).

    python -m bench.grammar_cost [--rounds 3] [--max-tokens 24]

Runs, alternately in each round so machine noise hits all alike, the same
question as plain text, as ``tool_choice: "auto"`` (two steps: one
grammar-held token, then free text), as a forced call to a named function
(grammar on every token) and as ``response_format: json_object``; prints, for
each, the median time of a whole request and its tokens (prompt and
completion), and the median decode time per completion token after the first
(prompt evaluation excluded: the tools' description makes a longer prompt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio

from workers.backend import Finished, GenerationRequest
from workers.llama_backend import LlamaBackend
from workers.models import bundled_model_path
from workers.tool_calls import ToolSpec

WEATHER = ToolSpec("get_weather", "Weather in a city", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"]}))
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "auto": {"tools": (WEATHER,), "tool_mode": "auto"},
    "named call": {"tools": (WEATHER,), "tool_mode": "function:get_weather"},
    "json_object": {"response_schema": '{"type": "object"}'},
}


async def one(backend: LlamaBackend, max_tokens: int,
              fields: dict[str, Any]) -> tuple[float, float, int, int]:
    """(whole ms, ms per token after the first, prompt tokens, completion tokens)."""
    request = GenerationRequest(
        messages=({"role": "user", "content": "What is the weather in Oslo?"},), prompt=None,
        max_tokens=max_tokens, temperature=0.0, **fields)
    started = time.perf_counter()
    first: float | None = None
    prompt = completion = 0
    async with backend.generate(request) as events:
        async for event in events:
            if isinstance(event, Finished):
                prompt, completion = event.prompt_tokens, event.completion_tokens
            elif first is None:
                first = time.perf_counter()
    ended = time.perf_counter()
    decode = (ended - (first or ended)) * 1000 / max(1, completion - 1)
    return (ended - started) * 1000, decode, prompt, completion


async def main(rounds: int, max_tokens: int) -> None:
    backend = LlamaBackend(bundled_model_path(), "m", slots=1)
    backend.warm_up()
    runs: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, fields in CASES.items():
            runs[name].append(await one(backend, max_tokens, fields))
    plain = statistics.median(r[1] for r in runs["plain"])
    for name, values in runs.items():
        whole = statistics.median(r[0] for r in values)
        decode = statistics.median(r[1] for r in values)
        print(f"{name:12s} request {whole:7.0f} ms  prompt {values[0][2]:4d} + completion "
              f"{values[0][3]:3d} tokens  decode {decode:6.1f} ms/token ({decode / plain:.1f}x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    anyio.run(main, args.rounds, args.max_tokens)
