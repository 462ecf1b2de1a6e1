"""An in-memory ASGI client for the gateway app: records what it was sent,
can hang up or read slowly; and a ``Gateway`` that runs clients against an app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from gateway.app import GatewayApp
from hedgerow.asgi import DISCONNECT_EXTENSION, Message
from hedgerow.http_stack.disconnect_hook import Disconnect
from hedgerow.sse import SseEvent, SseParser
from tests.support.fake_workers import FakeWorkers

MODEL = "m"


def body(stream: bool = True, **extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "stream": stream, "max_tokens": 16,
                         "messages": [{"role": "user", "content": "Count."}], **extra})


class HangUp:
    """The client hanging up: an event for ``receive()`` and, as the gateway's
    hypercorn does (``hedgerow.http_stack.disconnect_hook``), the server's
    ``hedgerow.disconnect`` callbacks fired at once."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.hook = Disconnect()

    def set(self) -> None:
        self.event.set()
        self.hook.fire()

    def is_set(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


@dataclass
class Client:
    """One ASGI connection: records what the app sent; can hang up or read slowly."""

    method: str
    path: str
    request_body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    sent: list[Message] = field(default_factory=list)
    hang_up: HangUp = field(default_factory=HangUp)
    finished: anyio.Event = field(default_factory=anyio.Event)
    read_delay_s: float = 0.0  # each write takes this long to be accepted
    stuck: bool = False  # writes are never accepted
    # The server offers the ``hedgerow.disconnect`` extension (as the gateway's
    # hypercorn does); False: the app learns of a hang-up from ``receive()`` only.
    disconnect_hook: bool = True
    _body_read: bool = False

    def scope(self) -> dict[str, Any]:
        path, _, query = self.path.partition("?")
        extensions = {DISCONNECT_EXTENSION: self.hang_up.hook} if self.disconnect_hook else {}
        return {"type": "http", "method": self.method, "path": path, "headers": self.headers,
                "query_string": query.encode(), "http_version": "1.1",
                "extensions": extensions}

    async def receive(self) -> Message:
        if not self._body_read:
            self._body_read = True
            return {"type": "http.request", "body": self.request_body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.stuck and message["type"] == "http.response.body":
            await anyio.sleep_forever()
        if self.read_delay_s and message["type"] == "http.response.body":
            await anyio.sleep(self.read_delay_s)
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"]) if self.sent else 0

    def header(self, name: str) -> str:
        return dict(self.sent[0]["headers"])[name.encode()].decode()

    def raw(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    def events(self) -> list[SseEvent]:
        return SseParser().feed(self.raw())

    def text(self) -> str:
        pieces = []
        for event in self.events():
            if event.data == "[DONE]":
                continue
            chunk = orjson.loads(event.data)
            for choice in chunk.get("choices") or []:
                pieces.append(choice["delta"].get("content") or "")
        return "".join(pieces)

    def json(self) -> Any:
        return orjson.loads(self.raw())


@dataclass
class Gateway:
    app: GatewayApp
    workers: FakeWorkers
    tg: Any

    def start(self, client: Client) -> Client:
        async def run() -> None:
            try:
                await self.app(client.scope(), client.receive, client.send)
            finally:
                client.finished.set()

        self.tg.start_soon(run)
        return client

    async def stream(self, *, headers: list[tuple[bytes, bytes]] | None = None,
                     request: bytes | None = None, **options: Any) -> Client:
        client = Client("POST", "/v1/chat/completions", request or body(),
                        headers=[(b"content-type", b"application/json"), *(headers or [])],
                        **options)
        return self.start(client)

    async def resume(self, request_id: str, last_event_id: int | str | None,
                     headers: list[tuple[bytes, bytes]] | None = None) -> Client:
        extra = [] if last_event_id is None else [(b"last-event-id", str(last_event_id).encode())]
        client = Client("GET", f"/v1/chat/completions/{request_id}/events",
                        headers=[*extra, *(headers or [])])
        return self.start(client)
