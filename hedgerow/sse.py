"""Incremental parsing of a Server-Sent Events byte stream (sans-IO).

Feed bytes as they arrive; complete events come out. Used by the gateway to
follow the control plane's watch stream and to relay workers' token streams
event by event (never buffering past an event boundary).
"""

from __future__ import annotations

from typing import NamedTuple

MAX_EVENT_BYTES = 4 * 1024 * 1024


class SseOverflow(ValueError):
    pass


class SseEvent(NamedTuple):  # a tuple: one is made per relayed token
    data: str
    event: str | None = None
    id: str | None = None
    raw: bytes = b""


class SseParser:
    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buffer = b""
        self._max = max_event_bytes

    def feed(self, data: bytes) -> list[SseEvent]:
        buffer = self._buffer + data if self._buffer else bytes(data)
        if b"\r" in buffer:
            return self._feed_with_cr(buffer)
        # No CR: no line end to normalise and none to hold back. A worker's
        # token event, ``data: {...}`` on one line, is taken without the
        # line-by-line parse (one per relayed token).
        events: list[SseEvent] = []
        start = 0
        try:
            while True:
                end = buffer.find(b"\n\n", start)
                if end < 0:
                    break
                block = buffer[start:end + 2]
                start = end + 2
                if block.startswith(b"data: ") and block.find(b"\n", 6) == len(block) - 2:
                    events.append(SseEvent(block[6:-2].decode("utf-8"), None, None, block))
                    continue
                event = _parse_block(block)
                if event is not None:
                    events.append(event)
        finally:
            self._buffer = buffer[start:] if start else buffer
        if len(self._buffer) > self._max:
            raise SseOverflow(f"SSE event larger than {self._max} bytes")
        return events

    def _feed_with_cr(self, buffer: bytes) -> list[SseEvent]:
        # A CRLF may be split across reads: hold a trailing CR until its LF comes.
        held = b"\r" if buffer.endswith(b"\r") else b""
        self._buffer = buffer[: len(buffer) - len(held)].replace(b"\r\n", b"\n")
        events: list[SseEvent] = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            block, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            event = _parse_block(block)
            if event is not None:
                events.append(event)
        self._buffer += held
        if len(self._buffer) > self._max:
            raise SseOverflow(f"SSE event larger than {self._max} bytes")
        return events


def _parse_block(block: bytes) -> SseEvent | None:
    data: list[str] = []
    name: str | None = None
    event_id: str | None = None
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
    if not data:
        return None
    return SseEvent("\n".join(data), name, event_id, block)
