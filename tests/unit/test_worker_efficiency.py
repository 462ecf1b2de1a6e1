"""Worker efficiency without a model: slot affinity, conversation keys, tiers, metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from policies.affinity import conversation_key
from policies.loader import parse_policy_document
from policies.routing import Candidate
from policies.scoring import RouteRequest, affinity_owner, score_workers
from policies.tiers import split_by_tier
from workers.backend import (
    ASSISTANT_MARK,
    BackendLoad,
    GenerationRequest,
    SlotPool,
    prompt_text,
    shared_prefix_chars,
    slot_preference,
)
from workers.main import WorkerOptions
from workers.metrics import WorkerMetrics

SYSTEM = ("system", "You are a helpful assistant.")


def turns(*texts: str) -> list[tuple[str, str]]:
    """A conversation: the system prompt, then user/assistant messages alternating."""
    roles = ["user", "assistant"]
    return [SYSTEM, *((roles[i % 2], text) for i, text in enumerate(texts))]


# -- slots: the free slot that shares the longest prefix ---------------------------


@pytest.mark.anyio
async def test_free_slot_with_the_best_affinity_is_taken_else_the_one_free_longest() -> None:
    held = {"a": "xyz", "b": "hello wor", "c": "hello"}
    pool = SlotPool(["a", "b", "c"])

    def score(slot: str) -> tuple[int, int]:
        return (shared_prefix_chars(held[slot], "hello world"), 0)

    assert await pool.acquire(score) == "b"
    assert await pool.acquire(score) == "c"
    pool.release("b")
    assert await pool.acquire(lambda slot: (0, 0)) == "a"  # a tie: the slot free the longest
    assert await pool.acquire() == "b"


def test_a_slot_is_reused_when_it_holds_most_of_the_prompt_else_an_empty_one_is_taken() -> None:
    prompt = "SYSTEM PROMPT " * 20 + "question"
    other_conversation = "SYSTEM PROMPT " * 20 + "another question and its answer"
    unrelated = "SYSTEM: something else entirely"
    ranked = sorted(["", unrelated, other_conversation],
                    key=lambda held: slot_preference(held, prompt), reverse=True)
    assert ranked == [other_conversation, "", unrelated]
    # Of two similar slots the longer shared prefix wins.
    longer = prompt[:-2]
    assert slot_preference(longer, prompt) > slot_preference(other_conversation, prompt)


def test_a_chat_turn_plus_its_answer_is_a_prefix_of_the_next_turn() -> None:
    def chat(messages: list[tuple[str, str]]) -> GenerationRequest:
        return GenerationRequest(messages=tuple({"role": r, "content": t} for r, t in messages),
                                 prompt=None, max_tokens=8)

    first = prompt_text(chat(turns("Hi")))
    second = prompt_text(chat(turns("Hi", "Hello! How can I help?", "Tell me a joke")))
    held = first + ASSISTANT_MARK + "Hello! How can I help?"
    assert second.startswith(held)
    other = prompt_text(chat(turns("Bye")))
    assert shared_prefix_chars(held, second) > shared_prefix_chars(other, second)


# -- gateway side: one key per conversation, tiers -----------------------------------


def test_every_turn_of_a_conversation_has_the_same_affinity_key_and_worker() -> None:
    conversation = turns("Hi", "Hello!", "What is a hedge?", "A row of bushes.", "Why?")
    keys = {conversation_key("m", conversation[: n + 1]) for n in range(1, len(conversation), 2)}
    assert len(keys) == 1
    workers = [Candidate(worker_id=f"w{i}", slots=4, reported_active=0, reported_queued=0)
               for i in range(8)]
    key = keys.pop()
    assert key is not None
    owner = affinity_owner(key, workers)
    route = RouteRequest(prompt_tokens=50, prefix_key=key)
    assert score_workers(workers, route, {})[0] == owner
    # Other conversations (another first question, another model) get other keys.
    assert conversation_key("m", turns("Hello there")) != key
    assert conversation_key("other", conversation) != key
    assert conversation_key("m", [SYSTEM]) is None


def tiered(wid: str, tier: str | None, active: int = 0) -> Candidate:
    return Candidate(worker_id=wid, slots=1, reported_active=active, reported_queued=0, tier=tier)


def test_a_class_tier_ranks_its_workers_first_and_falls_back_to_others() -> None:
    workers = [tiered("q4-a", "fast"), tiered("q8", "accurate"), tiered("q4-b", "fast"),
               tiered("plain", None)]
    accurate = RouteRequest(prompt_tokens=50, tier="accurate")
    assert [c.worker_id for c in score_workers(workers, accurate, {})][0] == "q8"
    fast = [c.worker_id for c in score_workers(workers, RouteRequest(50, tier="fast"), {})]
    assert set(fast[:2]) == {"q4-a", "q4-b"} and len(fast) == 4
    # The accurate worker is full: the request is served by another tier, not refused.
    spill = score_workers(workers, accurate, {"q8": 1})
    assert spill and "q8" not in [c.worker_id for c in spill]
    assert split_by_tier(workers, "none") == ([], workers)


def test_policy_classes_name_tiers() -> None:
    policy = parse_policy_document("""
classes:
  - {name: interactive, ttft_slo_ms: 1000, deadline_ms: 5000, tier: fast}
  - {name: premium, ttft_slo_ms: 2000, deadline_ms: 9000, tier: accurate}
  - {name: batch, ttft_slo_ms: 30000, deadline_ms: 90000}
tenants: [{name: local, class: interactive}]
anonymous_tenant: local
""")
    assert [c.tier for c in policy.classes] == ["fast", "accurate", None]


def test_worker_advertises_its_tier_and_quantization_as_labels() -> None:
    options = WorkerOptions(labels={"pop": "ams"}, quant="Q8_0", tier="accurate")
    assert options.advertised_labels() == {"pop": "ams", "tier": "accurate", "quant": "q8_0"}
    assert WorkerOptions().advertised_labels() == {}


# -- metrics --------------------------------------------------------------------------


def test_prompt_cache_and_draft_counters_are_exported() -> None:
    load = BackendLoad(slots=1, active=0, queued=0, tokens_per_s=0.0, generations_total=5,
                       cancelled_total=0, tokens_generated_total=40, prompt_cache_hits_total=3,
                       prompt_cache_misses_total=2, prompt_tokens_total=900,
                       prompt_tokens_reused_total=700, draft_tokens_total=50,
                       draft_tokens_accepted_total=30)
    text = WorkerMetrics(lambda: load, lambda: False).render().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("hedgerow_worker_prompt_cache_lookups_total", (("result", "hit"),))] == 3
    assert samples[("hedgerow_worker_prompt_cache_lookups_total", (("result", "miss"),))] == 2
    assert samples[("hedgerow_worker_prompt_tokens_reused_total", ())] == 700
    assert samples[("hedgerow_worker_prompt_tokens_total", ())] == 900
    assert samples[("hedgerow_worker_draft_tokens_total", ())] == 50
    assert samples[("hedgerow_worker_draft_tokens_accepted_total", ())] == 30
