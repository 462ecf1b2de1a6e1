from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgerow import openai_api as oa
from hedgerow.asgi import sse_event
from hedgerow.errors import InvalidRequest
from hedgerow.sse import SseOverflow, SseParser


def test_parser_yields_events_across_arbitrary_splits() -> None:
    stream = b"data: one\n\n: comment\n\ndata: two\ndata: lines\n\nid: 7\r\ndata: [DONE]\r\n\r\n"
    for cut in range(len(stream)):
        parser = SseParser()
        events = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        assert [e.data for e in events] == ["one", "two\nlines", "[DONE]"]
        assert events[-1].id == "7"


@given(st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=20)), max_size=5),
       st.integers(1, 7))
def test_sse_event_round_trips_json(payloads: list[dict[str, str]], chunk: int) -> None:
    wire = b"".join(sse_event(p) for p in payloads)
    parser = SseParser()
    events = []
    for i in range(0, len(wire), chunk):
        events += parser.feed(wire[i:i + chunk])
    assert [orjson.loads(e.data) for e in events] == payloads


def test_parser_is_bounded() -> None:
    with pytest.raises(SseOverflow):
        SseParser(max_event_bytes=10).feed(b"data: " + b"x" * 100)


def chat(**fields: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return orjson.dumps(body)


def test_valid_chat_request_parses() -> None:
    parsed = oa.parse_request(chat(stream=True, max_tokens=5, stop="x"), oa.ChatCompletionRequest)
    assert parsed.stream and parsed.token_limit() == 5 and parsed.stop_sequences() == ("x",)


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (orjson.dumps({"model": "m"}), "messages"),
    (chat(messages="hello"), "messages"),
    (chat(temperature="hot"), "temperature"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
    (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "model"),
])
def test_bad_requests_name_the_parameter(body: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        oa.parse_request(body, oa.ChatCompletionRequest)
    assert caught.value.status == 400
    assert caught.value.param == param
    envelope = caught.value.envelope()["error"]
    assert envelope["type"] == "invalid_request_error" and envelope["message"]


def test_text_parts_are_joined_a_line_each() -> None:
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parsed = oa.parse_request(chat(messages=[{"role": "user", "content": content}]),
                              oa.ChatCompletionRequest)
    assert parsed.messages[0].text() == "a\nb"
