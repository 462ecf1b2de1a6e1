"""``SseParser``'s fast path (no CR in the buffer; one-line ``data: `` events taken
whole) against the line-by-line parse it replaces on that path: the same
events, ``raw`` included, however the stream is cut."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hedgerow.sse import SseEvent, SseParser


def line_by_line(stream: bytes) -> list[SseEvent]:
    """The parse before the fast path: normalise CRLF, split at blank lines,
    read each block's fields (one call, the whole stream)."""
    events: list[SseEvent] = []
    buffer = stream.replace(b"\r\n", b"\n")
    while (end := buffer.find(b"\n\n")) >= 0:
        block, buffer = buffer[:end + 2], buffer[end + 2:]
        data: list[str] = []
        name = event_id = None
        for line in block.decode("utf-8").split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                data.append(value)
            elif field == "event":
                name = value
            elif field == "id":
                event_id = value
        if data:
            events.append(SseEvent("\n".join(data), name, event_id, block))
    return events


# Pieces that make the fast path's edges: one-line events, several data lines,
# other fields, comments, a data line without its space, empty data, text
# with colons and multi-byte characters, lone LFs, and (on the other path) CRLFs.
PIECES = st.sampled_from([
    b"data: ", b"data:", b"data: {\"a\": 1}", b"event: x", b"id: 7", b": keep-alive",
    b"\n", b"\n\n", b"\r\n", b"[DONE]", b"x:y", " \u00e9\u4e2d".encode(), b" ", b"data",
])


@given(st.lists(PIECES, max_size=24), st.lists(st.integers(0, 64), max_size=6))
def test_fast_path_reads_what_the_line_parse_reads(pieces: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(pieces)
    parser = SseParser()
    events: list[SseEvent] = []
    start = 0
    for cut in sorted(min(c, len(stream)) for c in cuts):
        events += parser.feed(stream[start:cut])
        start = cut
    events += parser.feed(stream[start:])
    assert events == line_by_line(stream)


def test_a_token_event_is_taken_whole() -> None:
    wire = b'data: {"choices": [{"delta": {"content": "a:b"}}]}\n\n'
    (event,) = SseParser().feed(wire)
    assert event == SseEvent('{"choices": [{"delta": {"content": "a:b"}}]}', None, None, wire)
    assert isinstance(event.raw, bytes)


def test_events_coalesced_in_one_read_come_out_in_order_with_the_rest_kept() -> None:
    parser = SseParser()
    assert [e.data for e in parser.feed(b"data: 1\n\ndata: 2\n\nevent: e\ndata: 3\n\ndata: 4")] \
        == ["1", "2", "3"]
    assert [e.data for e in parser.feed(b"\n\n")] == ["4"]


def test_an_event_of_more_lines_than_one_data_line_is_read_field_by_field() -> None:
    parser = SseParser()
    events = parser.feed(b"data: a\ndata: b\n\ndata: c\nevent: e\nid: 9\n\ndata: d\n: note\n\n")
    assert [(e.data, e.event, e.id) for e in events] == [
        ("a\nb", None, None), ("c", "e", "9"), ("d", None, None)]
