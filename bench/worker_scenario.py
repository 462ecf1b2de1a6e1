"""``hedgerow bench scenario worker``: the worker's efficiency levers on the real model.

Runs the bundled SmolLM2-135M in this process through ``LlamaBackend`` (the
code a worker serves with), one request at a time so each number is a
single generation's, and measures:

- **Prompt reuse.** Multi-turn chats that share a system prompt of 600
  tokens, their turns interleaved, more chats than the backend's two slots:
  time to first token (TTFT) of every turn three ways, turn by turn in
  rotation so drift on a shared machine hits all alike: Hedgerow's reuse (a
  slot keeps its KV cache and is picked by longest shared prefix);
  llama-cpp-python's default (slots handed out in turn, each context reusing
  whatever prefix it shares with the prompt, as the library does by itself:
  the baseline a user would otherwise run); and none (every prompt evaluated
  in full). Also the prompt tokens reused, from the backend's own counters.
- **Prompt-lookup decoding.** An extraction task (a completion that copies
  records listed in its prompt) at temperature 0, with and without drafting:
  decode tokens/s, drafted and accepted tokens, and whether the two answers
  are identical.
- **Warm start.** A fresh backend's first request with and without the
  warm-up generation (the model load itself, also reported, happens before a
  worker serves in both cases).
- **Quantization tiers.** Decode tokens/s of the bundled Q4_1 and of a Q8_0
  made from it (``workers.models.model_variant_path``).

Every slot runs one llama.cpp thread (``THREADS``) so that the numbers hold up
on a machine whose cores other work shares.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from workers.backend import Finished, GenerationRequest, TokenChunk
from workers.llama_backend import LlamaBackend
from workers.models import DEFAULT_MODEL_NAME, bundled_model_path, model_variant_path

log = logging.getLogger("hedgerow.bench.worker")

N_CTX = 2048

def system_prompt(rules: int = 16) -> str:
    """The shared system prompt; 16 rules are 604 tokens for SmolLM2's tokenizer."""
    return (
        "You are Hedgerow Assist, the support assistant of a company that runs an edge network "
        "for streaming chat models. Follow these rules in every answer. "
        + " ".join(
            f"Rule {i}: when a customer asks about topic {i}, answer briefly, name the relevant "
            f"setting, say whether a restart is needed, and never invent numbers or prices."
            for i in range(1, rules + 1)
        )
    )


SYSTEM_PROMPT = system_prompt()
QUESTIONS = (
    "How do I rotate my API key?",
    "Can I change the region of a worker?",
    "Why is my first token slow?",
    "Does the gateway retry failed requests?",
    "How many slots should a worker have?",
    "What happens when a worker drains?",
)

RECORDS = [
    ("Ada Park", "Berlin", "ada.park@example.org", "2024-03-11"),
    ("Bo Jensen", "Oslo", "bo.jensen@example.org", "2023-11-02"),
    ("Cy Moreau", "Lyon", "cy.moreau@example.org", "2024-07-19"),
    ("Di Rossi", "Milan", "di.rossi@example.org", "2022-05-30"),
    ("Ed Novak", "Prague", "ed.novak@example.org", "2024-01-08"),
    ("Fa Silva", "Porto", "fa.silva@example.org", "2023-09-27"),
    ("Gu Larsen", "Aarhus", "gu.larsen@example.org", "2024-02-14"),
    ("Ha Kim", "Busan", "ha.kim@example.org", "2023-06-21"),
]
# A completion that copies records from its own prompt (SmolLM2-135M does not
# reliably copy when asked to in a chat).
EXTRACTION = (
    "Customer records, one per line as id | name | city | email | joined:\n"
    + "\n".join(f"id={i} | " + " | ".join(record) for i, record in enumerate(RECORDS, 11))
    + "\n\nThe same records again, unchanged:\nid=11 |"
)
LOOKUP_TOKENS = 10  # llama-cpp-python's default draft length
# One llama.cpp thread a slot: its threads spin-wait, so on a machine whose cores
# are shared, more threads than free cores makes every number many times worse.
THREADS = 1


@dataclass
class Timed:
    ttft_s: float
    total_s: float
    decode_tokens_per_s: float | None
    text: str
    prompt_tokens: int
    completion_tokens: int


async def timed(backend: LlamaBackend, request: GenerationRequest) -> Timed:
    """One generation: time to first token, decode rate after it, the answer."""
    started = time.perf_counter()
    first = last = None
    chunks = 0
    parts: list[str] = []
    finished: Finished | None = None
    async with backend.generate(request) as events:
        async for event in events:
            now = time.perf_counter()
            if isinstance(event, TokenChunk):
                first = now if first is None else first
                last = now
                chunks += 1
                parts.append(event.text)
            elif isinstance(event, Finished):
                finished = event
    assert finished is not None and first is not None and last is not None
    rate = (chunks - 1) / (last - first) if chunks > 1 and last > first else None
    return Timed(first - started, time.perf_counter() - started, rate, "".join(parts),
                 finished.prompt_tokens, finished.completion_tokens)


def chat(messages: list[dict[str, str]], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(messages=tuple(messages), prompt=None, max_tokens=max_tokens,
                             temperature=0.0, seed=0)


def load(slots: int = 1, **options: Any) -> LlamaBackend:
    path = options.pop("model_path", None) or bundled_model_path()
    return LlamaBackend(path, DEFAULT_MODEL_NAME, slots=slots, n_ctx=N_CTX, n_threads=THREADS,
                        **options)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _p50_ms(values: list[float]) -> float:
    return _ms(statistics.median(values))


# -- prompt reuse ---------------------------------------------------------------


# How each mode is built: LlamaBackend keywords.
REUSE_MODES: dict[str, dict[str, bool]] = {
    "reuse": {"prompt_reuse": True, "slot_affinity": True},
    "library_default": {"prompt_reuse": True, "slot_affinity": False},
    "no_reuse": {"prompt_reuse": False},
}
REUSE_BASELINES = {
    "library_default": "llama-cpp-python's default: each context reuses the prefix it shares "
                       "with the prompt; slots handed out in turn (what a user would otherwise run)",
    "no_reuse": "every prompt evaluated in full (llama.reset() before each request)",
}


@dataclass(frozen=True)
class ReusePlan:
    chats: int = 3  # more than SLOTS: the chats do not all fit
    turns: int = 3
    rules: int = 16  # system prompt length (16: 604 tokens)
    answer_tokens: int = 12
    modes: tuple[str, ...] = ("reuse", "library_default", "no_reuse")


SLOTS = 2


async def conversations(backends: dict[str, LlamaBackend], plan: ReusePlan
                        ) -> dict[str, list[Timed]]:
    """``plan.chats`` conversations sharing one system prompt, their turns interleaved
    round-robin; each turn runs on every backend in turn (rotating which goes first)."""
    prompt = system_prompt(plan.rules)
    names = list(backends)
    histories = {name: [[{"role": "system", "content": prompt}] for _ in range(plan.chats)]
                 for name in names}
    results: dict[str, list[Timed]] = {name: [] for name in names}
    step = 0
    for turn in range(plan.turns):
        for index in range(plan.chats):
            question = QUESTIONS[(index + turn) % len(QUESTIONS)]
            order = names[step % len(names):] + names[:step % len(names)]
            step += 1
            for name in order:
                history = histories[name][index]
                history.append({"role": "user", "content": f"{question} (customer {index})"})
                result = await timed(backends[name], chat(history, plan.answer_tokens))
                history.append({"role": "assistant", "content": result.text})
                results[name].append(result)
    return results


async def prompt_reuse(quick: bool) -> dict[str, Any]:
    return await measure_prompt_reuse(ReusePlan() if quick else ReusePlan(chats=4, turns=6))


async def measure_prompt_reuse(plan: ReusePlan) -> dict[str, Any]:
    out: dict[str, Any] = {"chats": plan.chats, "turns": plan.turns, "slots": SLOTS,
                           "baseline": "library_default", "baselines": REUSE_BASELINES}
    backends: dict[str, LlamaBackend] = {}
    try:
        for mode in plan.modes:
            backends[mode] = load(slots=SLOTS, **REUSE_MODES[mode])
            backends[mode].warm_up()
        results = await conversations(backends, plan)
        counted = {mode: backend.load() for mode, backend in backends.items()}
    finally:
        for backend in backends.values():
            backend.close()
    for mode in plan.modes:
        ttfts = [r.ttft_s for r in results[mode]]
        out[f"ttft_p50_ms_{mode}"] = _p50_ms(ttfts)
        out[f"ttft_p50_ms_{mode}_first_turns"] = _p50_ms(ttfts[:plan.chats])
        out[f"ttft_p50_ms_{mode}_later_turns"] = _p50_ms(ttfts[plan.chats:])
        out[f"prompt_tokens_p50_{mode}"] = statistics.median(r.prompt_tokens for r in results[mode])
        out[f"prompt_cache_hits_{mode}"] = counted[mode].prompt_cache_hits_total
        out[f"prompt_cache_misses_{mode}"] = counted[mode].prompt_cache_misses_total
        out[f"reused_token_fraction_{mode}"] = round(
            counted[mode].prompt_tokens_reused_total / max(1, counted[mode].prompt_tokens_total), 3)
    for mode in plan.modes:
        if mode != "reuse" and "reuse" in plan.modes:
            out[f"reuse_ttft_speedup_vs_{mode}"] = round(
                out[f"ttft_p50_ms_{mode}"] / out["ttft_p50_ms_reuse"], 2)
    if "no_reuse" in plan.modes and "reuse" in plan.modes:
        out["reuse_ttft_speedup"] = out["reuse_ttft_speedup_vs_no_reuse"]
    return out


# -- prompt-lookup decoding -------------------------------------------------------


async def prompt_lookup(quick: bool) -> dict[str, Any]:
    rounds = 2 if quick else 5
    request = GenerationRequest(messages=None, prompt=EXTRACTION, max_tokens=96 if quick else 160,
                                temperature=0.0, seed=0)
    out: dict[str, Any] = {"task": "copy 8 records (completion)", "rounds": rounds,
                           "draft_tokens_per_pass": LOOKUP_TOKENS}
    texts: dict[str, str] = {}
    for mode, lookup in (("plain", 0), ("lookup", LOOKUP_TOKENS)):
        backend = load(prompt_lookup_tokens=lookup, prompt_reuse=False)
        try:
            backend.warm_up()
            results = [await timed(backend, request) for _ in range(rounds)]
            counted = backend.load()
        finally:
            backend.close()
        rates = [r.decode_tokens_per_s for r in results if r.decode_tokens_per_s]
        out[f"tokens_per_s_{mode}"] = round(statistics.median(rates), 1)
        out[f"completion_tokens_{mode}"] = results[0].completion_tokens
        out[f"generation_ms_p50_{mode}"] = _p50_ms([r.total_s for r in results])
        texts[mode] = results[0].text
        if lookup:
            out["draft_tokens"] = counted.draft_tokens_total
            out["draft_tokens_accepted"] = counted.draft_tokens_accepted_total
            out["draft_acceptance_rate"] = round(
                counted.draft_tokens_accepted_total / max(1, counted.draft_tokens_total), 3)
    out["lookup_output_identical"] = texts["plain"] == texts["lookup"]
    out["lookup_speedup"] = round(out["tokens_per_s_lookup"] / out["tokens_per_s_plain"], 2)
    return out


# -- warm start -------------------------------------------------------------------


async def first_request(warm: bool) -> tuple[float, float]:
    """(model load seconds, first request's TTFT seconds) on a fresh backend."""
    started = time.perf_counter()
    backend = load()
    loaded = time.perf_counter() - started
    try:
        if warm:
            backend.warm_up()
        result = await timed(backend, chat([{"role": "user", "content": QUESTIONS[0]}], 8))
    finally:
        backend.close()
    return loaded, result.ttft_s


async def warm_start(quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 7
    cold: list[tuple[float, float]] = []
    warm: list[tuple[float, float]] = []
    for _ in range(rounds):  # alternate, so drift on a shared machine hits both alike
        cold.append(await first_request(warm=False))
        warm.append(await first_request(warm=True))
    return {
        "rounds": rounds,
        "cold_first_ttft_ms": _p50_ms([ttft for _, ttft in cold]),
        "warm_first_ttft_ms": _p50_ms([ttft for _, ttft in warm]),
        "model_load_ms": _p50_ms([loaded for loaded, _ in cold + warm]),
        # What a first request would wait if workers loaded their model on demand.
        "lazy_load_first_ttft_ms": _p50_ms([loaded + ttft for loaded, ttft in cold]),
    }


# -- quantization tiers -----------------------------------------------------------


async def tiers(quick: bool) -> dict[str, Any]:
    rounds = 1 if quick else 4
    request = chat([{"role": "user", "content": "Write a short poem about hedges."}], 64)
    out: dict[str, Any] = {}
    for quant in ("q4_1", "q8_0"):
        started = time.perf_counter()
        path = model_variant_path(quant)
        prepared = time.perf_counter() - started
        backend = load(model_path=path)
        try:
            backend.warm_up()
            results = [await timed(backend, request) for _ in range(rounds)]
        finally:
            backend.close()
        rates = [r.decode_tokens_per_s for r in results if r.decode_tokens_per_s]
        out[quant] = {"file_mb": round(path.stat().st_size / 2**20, 1),
                      "prepare_ms": _ms(prepared),
                      "tokens_per_s": round(statistics.median(rates), 1),
                      "ttft_ms": _p50_ms([r.ttft_s for r in results])}
    return out


def worker(quick: bool, workdir: Path) -> dict[str, Any]:
    """The scenario: every part in turn; the headline numbers at the top level."""
    parts: dict[str, Callable[[bool], Any]] = {
        "prompt_reuse": prompt_reuse, "prompt_lookup": prompt_lookup,
        "warm_start": warm_start, "tiers": tiers,
    }
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for name, part in parts.items():
        log.info("worker scenario: %s", name)
        results[name] = anyio.run(part, quick)
    reuse, lookup, warm = results["prompt_reuse"], results["prompt_lookup"], results["warm_start"]
    return {
        "ttft_p50_ms_reuse": reuse["ttft_p50_ms_reuse"],
        "ttft_p50_ms_no_reuse": reuse["ttft_p50_ms_no_reuse"],
        "ttft_p50_ms_library_default": reuse["ttft_p50_ms_library_default"],
        "baseline": "library_default (prompt reuse); plain decoding (lookup); no warm-up (warm start)",
        "tokens_per_s_lookup": lookup["tokens_per_s_lookup"],
        "tokens_per_s_plain": lookup["tokens_per_s_plain"],
        "cold_first_ttft_ms": warm["cold_first_ttft_ms"],
        "warm_first_ttft_ms": warm["warm_first_ttft_ms"],
        **results,
        "duration_s": round(time.perf_counter() - started, 1),
    }
