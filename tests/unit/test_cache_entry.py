"""Cached answers: compact encoding, and replay shaped exactly like a live answer."""

from __future__ import annotations

import orjson
import pytest

from gateway.cache.entry import (
    CacheEntry,
    EntryBuilder,
    EntryDecodeError,
    entry_from_response,
    json_replay,
    replay_events,
    sse_replay,
    text_pieces,
)
from hedgerow import openai_api as oa
from hedgerow.sse import SseParser

TEXT = "Five kilometres is about 3.1 miles,\nroughly a 30 minute walk.  "
ENTRY = CacheEntry(TEXT, "stop", 21, 17, "smollm2-135m-instruct", 1_700_000_000)


def replayed(entry: CacheEntry, **kwargs: object) -> list[str]:
    parser = SseParser()
    events = []
    for chunk in sse_replay(entry, "req1", **kwargs):  # type: ignore[arg-type]
        events.extend(parser.feed(chunk))
    return [event.data for event in events]


def test_encoding_round_trips_and_is_compact() -> None:
    data = ENTRY.encode()
    assert CacheEntry.decode(data) == ENTRY
    assert len(data) < len(TEXT) + 60
    with pytest.raises(EntryDecodeError):
        CacheEntry.decode(b'{"text": "x"}')


def test_pieces_are_a_few_words_and_rejoin_exactly() -> None:
    pieces = list(text_pieces(TEXT))
    assert "".join(pieces) == TEXT
    assert len(pieces) >= 3
    assert all(len(p.split()) <= 4 for p in pieces)


def test_sse_replay_is_a_valid_chunk_sequence_with_usage() -> None:
    data = replayed(ENTRY, model="smollm2", include_usage=True)
    assert data[-1] == "[DONE]"
    chunks = [orjson.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-req1"
               and c["model"] == "smollm2" for c in chunks)
    assert len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2]]
    assert "".join(content) == TEXT and len(content) > 1
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 21, "completion_tokens": 17, "total_tokens": 38}


def test_sse_replay_matches_the_live_builders_event_for_event() -> None:
    """The same bytes a worker sends for the same answer split the same way."""
    short = CacheEntry("Hello there", "length", 3, 2, "m", 5)
    live = [
        b"data: " + orjson.dumps(oa.chat_chunk("r", "m", 9, {"role": "assistant", "content": ""})) + b"\n\n",
        b"data: " + orjson.dumps(oa.chat_chunk("r", "m", 9, {"content": "Hello there"})) + b"\n\n",
        b"data: " + orjson.dumps(oa.chat_chunk("r", "m", 9, {}, "length")) + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    assert list(sse_replay(short, "r", created=9)) == live


def test_without_include_usage_there_is_no_usage_chunk() -> None:
    data = replayed(ENTRY)
    assert all("usage" not in orjson.loads(d) for d in data[:-1])


def test_text_completion_replay() -> None:
    entry = CacheEntry("once upon a time there was", "stop", 4, 6, "m", 1, chat=False)
    chunks = [orjson.loads(d) for d in replayed(entry, include_usage=True)[:-1]]
    assert all(c["object"] in ("text_completion", "chat.completion.chunk") for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == entry.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["total_tokens"] == 10


def test_json_replay_and_entry_from_response_round_trip() -> None:
    body = json_replay(ENTRY, "req1", model="smollm2", created=7)
    assert body == oa.chat_completion("req1", "smollm2", 7, TEXT, "stop", oa.usage(21, 17))
    back = entry_from_response(body)
    assert back is not None and back.text == TEXT and back.completion_tokens == 17
    text_body = oa.text_completion("r", "m", 1, "abc", "stop", oa.usage(1, 1))
    text_entry = entry_from_response(text_body)
    assert text_entry is not None and not text_entry.chat and text_entry.text == "abc"


CALL = {"id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def tool_call_body() -> dict[str, object]:
    body = oa.chat_completion("r", "m", 1, "", "tool_calls", oa.usage(9, 8))
    body["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    return body


def test_a_tool_call_answer_is_stored_and_replayed_intact() -> None:
    entry = entry_from_response(tool_call_body())
    assert entry is not None and CacheEntry.decode(entry.encode()) == entry
    assert json_replay(entry, "r", created=1) == tool_call_body()
    builder = EntryBuilder()
    for data in replayed(entry, include_usage=True, created=1)[:-1]:
        builder.feed(orjson.loads(data))
    assert builder.build() == entry


def test_answers_that_cannot_be_replayed_exactly_are_not_stored() -> None:
    nameless = tool_call_body()
    nameless["choices"][0]["message"]["tool_calls"] = [{"id": "x"}]  # type: ignore[index]
    assert entry_from_response(nameless) is None
    two = oa.chat_completion("r", "m", 1, "a", "stop", oa.usage(1, 1))
    two["choices"].append({**two["choices"][0], "index": 1})
    assert entry_from_response(two) is None
    misspelt = oa.chat_completion("r", "m", 1, "Hello", "stop", oa.usage(1, 1))
    misspelt["choices"][0]["logprobs"] = {"content": [
        {"token": "Help", "logprob": -1.0, "bytes": None, "top_logprobs": []}]}
    assert entry_from_response(misspelt) is None


def test_logprobs_are_replayed_a_token_a_chunk() -> None:
    body = oa.chat_completion("r", "m", 1, "Hello", "stop", oa.usage(1, 2))
    entries = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
               for t in ("Hel", "lo")]
    body["choices"][0]["logprobs"] = {"content": entries, "refusal": None}
    entry = entry_from_response(body)
    assert entry is not None and json_replay(entry, "r", created=1) == body
    contents = [orjson.loads(d)["choices"][0] for d in replayed(entry)[1:3]]
    assert [c["delta"]["content"] for c in contents] == ["Hel", "lo"]
    assert [c["logprobs"]["content"] for c in contents] == [[entries[0]], [entries[1]]]


def test_a_replayed_stream_builds_back_the_same_entry() -> None:
    builder = EntryBuilder()
    for data in replayed(ENTRY, include_usage=True)[:-1]:
        builder.feed(orjson.loads(data))
    rebuilt = builder.build()
    assert rebuilt is not None
    assert (rebuilt.text, rebuilt.finish_reason, rebuilt.usage()) == (TEXT, "stop", ENTRY.usage())


def test_an_unfinished_stream_builds_nothing() -> None:
    builder = EntryBuilder()
    for data in replayed(ENTRY)[:3]:
        builder.feed(orjson.loads(data))
    assert builder.build() is None


@pytest.mark.parametrize("which", ["text", "chat", "tool call", "logprobs", "completion"])
def test_replay_events_carry_the_kinds_the_relay_gives_the_same_events(which: str) -> None:
    # A hit goes into a stream log without being parsed back (gateway.cached_answers):
    # its events and kinds must be those of parsing the SSE and classifying it, as
    # a live worker's are (gateway.corridor.generation.classify).
    from gateway.corridor.generation import classify
    from gateway.corridor.relay import RelayOutcome

    logprob_body = oa.chat_completion("r", "m", 1, "Hello", "stop", oa.usage(1, 2))
    logprob_body["choices"][0]["logprobs"] = {"content": [
        {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
        for t in ("Hel", "lo")], "refusal": None}
    entries = {"text": ENTRY, "chat": ENTRY,
               "tool call": entry_from_response(tool_call_body()),
               "logprobs": entry_from_response(logprob_body),
               "completion": CacheEntry(TEXT, "length", 3, 4, "m", 1, chat=False)}
    entry = entries[which]
    assert entry is not None
    parser, seen = SseParser(), RelayOutcome()
    parsed = [(classify(event, seen), event.raw) for chunk in
              sse_replay(entry, "r", created=1, include_usage=True) for event in parser.feed(chunk)]
    assert list(replay_events(entry, "r", created=1, include_usage=True)) == parsed
    assert sum(kind == "token" for kind, _ in parsed) >= 1
