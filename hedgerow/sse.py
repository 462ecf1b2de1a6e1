"""Incremental parsing of a Server-Sent Events byte stream (sans-IO).

Feed bytes as they arrive; complete events come out. Used by the gateway to
follow the control plane's watch stream and to relay workers' token streams
event by event (never buffering past an event boundary).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_EVENT_BYTES = 4 * 1024 * 1024


class SseOverflow(ValueError):
    pass


@dataclass(frozen=True)
class SseEvent:
    data: str
    event: str | None = None
    id: str | None = None
    raw: bytes = b""


class SseParser:
    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buffer = b""
        self._max = max_event_bytes

    def feed(self, data: bytes) -> list[SseEvent]:
        self._buffer += data
        # A CRLF may be split across reads: hold a trailing CR until its LF comes.
        held = b"\r" if self._buffer.endswith(b"\r") else b""
        self._buffer = self._buffer[: len(self._buffer) - len(held)].replace(b"\r\n", b"\n")
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
