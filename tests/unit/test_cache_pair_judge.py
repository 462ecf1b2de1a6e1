"""The pair-model judge: choosing among candidates, the lookup around it, its wire
frames, and the sidecar serving it (the bag-of-words twin: seconds, no model).
The real model is in tests/integration/test_pair_model.py."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import anyio
import numpy as np
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from gateway.cache.embed_sidecar import SidecarEmbedder
from gateway.cache.embed_wire import (
    JUDGE,
    REQUEST_HEAD,
    ProtocolError,
    judge_frame,
    read_request,
    request_frame,
)
from gateway.cache.embedder import MAX_TEXT_CHARS, EmbedderBusy
from gateway.cache.entry import CacheEntry
from gateway.cache.keys import CacheKeys
from gateway.cache.pair_model import MAX_CANDIDATES
from gateway.cache.semantic import (
    JUDGE_REFUSED,
    SemanticIndex,
    SemanticItem,
    SemanticMatch,
    SemanticMiss,
    choose,
    typed_alike,
    typing_key,
)
from gateway.cache.semantic_cache import SemanticCache, SemanticSettings
from gateway.cache.store import Guarded, Purge, RedisCircuit
from hedgerow.actors import RestartPolicy
from tests.support.cache_fakes import bag_of_words

pytestmark = pytest.mark.anyio

DIM = 384


def item(item_id: str, question: str, *, expires: float = 1e12) -> SemanticItem:
    return SemanticItem(item_id, "ns", "tenant:a", "m", f"key-{item_id}", question,
                        bag_of_words(question), CacheEntry(f"answer {item_id}", "stop", 1, 1, "m", 0),
                        expires)


def index(*questions: str) -> SemanticIndex:
    idx = SemanticIndex(DIM, max_entries_per_namespace=100, max_namespaces=10, hnsw_above=50)
    for n, question in enumerate(questions):
        idx.add(item(str(n), question), now=0)
    return idx


# -- choosing -----------------------------------------------------------------

def test_choose_takes_the_highest_score_not_the_nearest_vector() -> None:
    candidates = [SemanticMatch(item("0", "a"), 0.9), SemanticMatch(item("1", "b"), 0.7)]
    found = choose(candidates, [0.95, 0.99], threshold=0.98)
    assert isinstance(found, SemanticMatch) and found.item.item_id == "1" and found.score == 0.99


def test_choose_misses_below_the_threshold_and_says_the_judge_refused() -> None:
    candidates = [SemanticMatch(item("0", "a"), 0.9), SemanticMatch(item("1", "b"), 0.7)]
    found = choose(candidates, [0.97, 0.5], threshold=0.98)
    assert found == SemanticMiss(0.9, JUDGE_REFUSED)
    assert choose([], [], threshold=0.5) == SemanticMiss(-1.0, None)


def test_candidates_are_the_nearest_live_entries_above_the_floor_up_to_the_limit() -> None:
    idx = index("how do i bake bread", "how do i bake sourdough bread", "bake bread how",
                "what is the capital of peru")
    idx.add(item("old", "how do i bake bread quickly", expires=5), now=0)
    query = bag_of_words("how do i bake bread")
    found = idx.candidates("ns", query, floor=0.5, limit=2, now=10)
    assert [c.item.item_id for c in found] == ["0", "1"]  # most words shared first; 'old' expired
    assert all(c.score >= 0.5 for c in found)
    assert len(idx.candidates("ns", query, floor=0.5, limit=8, now=10)) == 3  # not peru
    assert idx.candidates("other", query, floor=0.5, limit=2, now=10) == []


# -- the lookup ---------------------------------------------------------------

class ScriptedJudge:
    def __init__(self, scores: dict[str, float] | None = None, *, error: bool = False,
                 delay_s: float = 0.0) -> None:
        self.scores, self.error, self.delay_s = scores or {}, error, delay_s
        self.asked: list[tuple[str, list[str]]] = []

    async def judge(self, question: str, cached: Sequence[str]) -> np.ndarray:
        self.asked.append((question, list(cached)))
        await anyio.sleep(self.delay_s)
        if self.error:
            raise EmbedderBusy("no pair model in this sidecar")
        return np.array([self.scores.get(c, 0.0) for c in cached], dtype=np.float32)


class VectorsOnly:
    """An embedder that cannot judge (as an in-process MiniLM)."""

    dim = DIM

    async def embed(self, text: str) -> np.ndarray:
        return bag_of_words(text)


def semantic(idx: SemanticIndex, pair_judge: ScriptedJudge | None,
             **settings: object) -> SemanticCache:
    guard = Guarded(0.05, RedisCircuit(5.0), lambda: 0.0)
    options = {"max_candidates": 3, "candidate_floor": 0.3, **settings}
    return SemanticCache(idx, VectorsOnly(), SemanticSettings(0.8, 60, **options),  # type: ignore[arg-type]
                         None, guard, judge=pair_judge)


def keys(question: str) -> CacheKeys:
    return CacheKeys("tenant:a", "m", "exact-key", "ns", question)


async def test_a_lookup_asks_the_judge_about_its_candidates_and_takes_its_answer() -> None:
    idx = index("can dogs eat cat food", "can cats eat dog food", "what is a haiku")
    judge = ScriptedJudge({"can dogs eat cat food": 0.99, "can cats eat dog food": 0.2})
    cache = semantic(idx, judge, pair_threshold=0.98)
    question = "is cat food ok for dogs to eat"
    found = await cache.find(keys(question), bag_of_words(question), now=1)
    assert isinstance(found, SemanticMatch) and found.item.question == "can dogs eat cat food"
    ((asked, cached),) = judge.asked
    assert asked == question and set(cached) == {"can dogs eat cat food", "can cats eat dog food"}


async def test_a_judge_that_refuses_every_candidate_is_a_miss_counted_by_reason() -> None:
    idx = index("can dogs eat cat food")
    cache = semantic(idx, ScriptedJudge({"can dogs eat cat food": 0.97}), pair_threshold=0.98)
    found = await cache.find(keys("can cats eat dog food"), bag_of_words("can cats eat dog food"), 1)
    assert isinstance(found, SemanticMiss) and found.rejected_by == JUDGE_REFUSED
    assert cache.guard_rejections == {JUDGE_REFUSED: 1}


@pytest.mark.parametrize("judge", [None, ScriptedJudge(error=True),
                                   ScriptedJudge({"can dogs eat cat food": 1.0}, delay_s=1.0)],
                         ids=["no judge", "judge failed", "judge too slow"])
async def test_without_a_judge_answer_a_lookup_misses_and_never_falls_back_to_cosine(
        judge: ScriptedJudge | None) -> None:
    idx = index("can dogs eat cat food")
    cache = semantic(idx, judge, embed_timeout_s=0.1)
    question = "cat food: can dogs eat it"  # the same words and one more: the cosine judge would hit
    found = await cache.find(keys(question), bag_of_words(question), now=1)
    assert isinstance(found, SemanticMiss) and found.rejected_by is None


@pytest.mark.parametrize("judge", [ScriptedJudge({"How far is 5 km in miles?": 0.005}),
                                   ScriptedJudge(error=True), None],
                         ids=["judge says no", "judge failed", "no judge"])
async def test_a_question_worded_as_a_cached_one_is_a_hit_without_the_judge(
        judge: ScriptedJudge | None) -> None:
    """Whitespace, the first capital and the closing mark are typing, not meaning:
    the trained judge scores such near-copies low, so it is not asked."""
    idx = index("How far is 5 km in miles?")
    cache = semantic(idx, judge)
    question = "how far is 5 km  in miles"
    found = await cache.find(keys(question), bag_of_words(question), now=1)
    assert isinstance(found, SemanticMatch) and found.score == 1.0
    assert found.item.question == "How far is 5 km in miles?"
    assert judge is None or judge.asked == []


def test_only_typing_is_ignored_never_a_mark_or_capital_that_can_be_meaning() -> None:
    assert typed_alike("  How far is 5 km in miles? ", "how far is 5 km   in miles")
    assert typed_alike("Is it 5 km?", "is it 5 km.")
    for one, other in [("my speed test says 50 MB/s", "my speed test says 50 Mb/s"),
                       ("What is 10!", "What is 10?"),  # a factorial
                       ("Explain cd ..", "Explain cd"), ("Explain sudo !!", "Explain sudo"),
                       ("Translate to German: Stop!", "Translate to German: Stop."),
                       ("G in SI units?", "g in SI units?"),  # a constant, not a word's capital
                       ("is it 5 km", "is it 50 km")]:
        assert not typed_alike(one, other), (one, other)
    assert typing_key("?") is None and not typed_alike("?", "...")


@pytest.mark.timeout(10)
def test_a_long_run_of_marks_is_read_in_linear_time() -> None:
    """A question can be 256 KiB: a backtracking pattern took minutes on this."""
    assert typing_key("?" * 300_000 + "a") == "?" * 300_000 + "a"
    assert not typed_alike("?" * 300_000 + "a", "?" * 300_000 + "b")


async def test_a_question_typed_alike_in_another_namespace_is_not_a_hit() -> None:
    idx = index("How far is 5 km in miles?")
    cache = semantic(idx, ScriptedJudge())
    question = "how far is 5 km in miles"
    other_tenant = CacheKeys("tenant:b", "m", "exact-key", "another-ns", question)
    assert isinstance(await cache.find(other_tenant, bag_of_words(question), now=1), SemanticMiss)


async def test_a_case_difference_inside_the_question_still_goes_to_the_judge() -> None:
    idx = index("my speed test says 50 MB/s is that good")
    judge = ScriptedJudge({"my speed test says 50 MB/s is that good": 0.01})
    cache = semantic(idx, judge, pair_threshold=0.5)
    question = "My speed test says 50 Mb/s is that good?"
    found = await cache.find(keys(question), bag_of_words(question), now=1)
    assert isinstance(found, SemanticMiss) and found.rejected_by == JUDGE_REFUSED
    assert len(judge.asked) == 1


async def test_the_cosine_judge_still_applies_threshold_and_guards() -> None:
    idx = index("how far is 5 km in miles")
    judge = ScriptedJudge()
    cache = semantic(idx, judge, judge="cosine")
    near = "how far is 5 km in miles please"
    assert isinstance(await cache.find(keys(near), bag_of_words(near), 1), SemanticMatch)
    other = "how far is 50 km in miles please"
    refused = await cache.find(keys(other), bag_of_words(other), 1)
    assert isinstance(refused, SemanticMiss) and refused.rejected_by == "numbers"
    assert judge.asked == []


# -- the wire -----------------------------------------------------------------

async def _read(frame: bytes) -> object:
    send, receive = anyio.create_memory_object_stream[bytes](1)
    await send.send(frame)
    await send.aclose()
    return await read_request(BufferedByteReceiveStream(receive))


async def test_a_judge_frame_round_trips_and_embeds_still_do() -> None:
    request = await _read(judge_frame(7, "new ünïcode", ["one", "two"]))
    assert request.request_id == 7 and request.op == JUDGE  # type: ignore[attr-defined]
    assert request.texts == ("new ünïcode", "one", "two")  # type: ignore[attr-defined]
    assert (await _read(request_frame(8, "text"))).texts == ("text",)  # type: ignore[attr-defined]


def test_a_judge_frame_holds_one_to_max_candidates_cached_questions() -> None:
    with pytest.raises(ValueError):
        judge_frame(1, "q", [])
    with pytest.raises(ValueError):
        judge_frame(1, "q", ["c"] * (MAX_CANDIDATES + 1))
    assert len(judge_frame(1, "q" * (5 * MAX_TEXT_CHARS), ["c"])) < 5 * MAX_TEXT_CHARS


@pytest.mark.parametrize("payload", [
    struct.pack("<I", 5) + b"abc",  # a text cut short
    struct.pack("<I", 1) + b"q",  # a question with nothing to judge it against
    b"".join(struct.pack("<I", 1) + b"x" for _ in range(MAX_CANDIDATES + 2)),  # too many
    b"\x01\x00",  # a length cut short
], ids=["cut", "alone", "too many", "short length"])
async def test_a_malformed_judge_request_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        await _read(REQUEST_HEAD.pack(1, JUDGE, len(payload)) + payload)


async def test_an_unknown_op_or_an_oversized_judge_request_is_refused_before_reading_it() -> None:
    with pytest.raises(ProtocolError):
        await _read(REQUEST_HEAD.pack(1, 9, 3) + b"abc")
    with pytest.raises(ProtocolError):
        await _read(REQUEST_HEAD.pack(1, JUDGE, 1 << 30))


# -- the sidecar --------------------------------------------------------------

def _sidecar(mode: str) -> SidecarEmbedder:
    return SidecarEmbedder(server=("-m", "tests.support.fake_embed_server", "--mode", mode),
                           restart_policy=RestartPolicy(backoff_initial=0.05, max_restarts=3),
                           start_timeout_s=30)


async def test_the_sidecar_judges_and_embeds_over_one_connection() -> None:
    sidecar = _sidecar("ok")
    async with anyio.create_task_group() as tg:
        await tg.start(sidecar.run)
        cached = ["how do i bake bread", "what is the capital of peru"]
        scores, vector = await sidecar.judge("how do i bake bread", cached), \
            await sidecar.embed("bread")
        tg.cancel_scope.cancel()
    assert scores.shape == (2,) and scores[0] == pytest.approx(1.0) and scores[1] < 0.2
    assert np.allclose(vector, bag_of_words("bread"))
    assert sidecar.judged == 1 and sidecar.judge_failures == 0


async def test_a_sidecar_without_a_pair_model_still_embeds_and_every_judgement_misses() -> None:
    sidecar = _sidecar("no-pair")
    async with anyio.create_task_group() as tg:
        await tg.start(sidecar.run)
        with pytest.raises(EmbedderBusy, match="no pair model"):
            await sidecar.judge("how do i bake bread", ["how do i bake bread"])
        assert np.allclose(await sidecar.embed("bread"), bag_of_words("bread"))
        assert sidecar.ready  # a failed judgement is a miss, not a broken sidecar
        tg.cancel_scope.cancel()
    assert sidecar.judge_failures == 1


async def test_a_judgement_refused_before_the_sidecar_is_ready_is_not_a_missing_pair_model() -> None:
    """Only the sidecar's own FAILED answers feed hedgerow_cache_judgements_failed_total
    (and its alert); a refusal under load or at start counts as refused."""
    sidecar = _sidecar("ok")
    with pytest.raises(EmbedderBusy, match="not ready"):
        await sidecar.judge("how do i bake bread", ["how do i bake bread"])
    assert (sidecar.refused, sidecar.judge_failures) == (1, 0)


async def test_an_answer_purged_while_the_judge_reads_it_is_not_served() -> None:
    idx = index("can dogs eat cat food")

    class PurgingJudge(ScriptedJudge):
        async def judge(self, question: str, cached: Sequence[str]) -> np.ndarray:
            idx.purge(Purge(tenant="a"))  # an operator's purge lands mid-judgement
            return await super().judge(question, cached)

    cache = semantic(idx, PurgingJudge({"can dogs eat cat food": 1.0}))
    question = "is cat food ok for dogs to eat"
    found = await cache.find(keys(question), bag_of_words(question), now=1)
    assert isinstance(found, SemanticMiss)
