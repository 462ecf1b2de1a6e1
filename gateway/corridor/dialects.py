"""The public APIs that share the one completion path: OpenAI's and Anthropic's.

A ``Dialect`` says how a route's request reaches the chat path: how its
body becomes an OpenAI request dict (``decode``) and where its API key is
(``credential``). Everything after that -- admission, cache, single-flight,
EDF queue, hedging, the relay -- is the same code for every dialect.
Anthropic's answer is then rewritten on its way out by ``AnthropicSend``,
which wraps the ASGI ``send`` of a ``/v1/messages`` request: a JSON body
becomes a ``message``, an SSE stream Anthropic's events
(``hedgerow.anthropic_reply``). Errors raised before the answer starts are
rendered in Anthropic's shape by the route (``errors.AnthropicShaped``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.corridor.relay import HEARTBEAT
from hedgerow import anthropic_api
from hedgerow import openai_api as oa
from hedgerow.anthropic_reply import MessageStream, message_of
from hedgerow.asgi import Handler, Message, Request
from hedgerow.errors import AnthropicShaped, HedgerowError
from hedgerow.sse import SseParser

STOP_SEQUENCES = "hedgerow.stop_sequences"  # scope key: the Anthropic request's, for its answer


def _openai_decode(request: Request, body: bytes) -> dict[str, Any]:
    return oa.decode_request(body)


def _authorization(request: Request) -> str | None:
    return request.header("authorization")


@dataclass(frozen=True)
class Dialect:
    shape: type[oa.ChatCompletionRequest] | type[oa.CompletionRequest]
    upstream_path: str  # what the workers are asked on
    decode: Callable[[Request, bytes], dict[str, Any]] = _openai_decode
    credential: Callable[[Request], str | None] = _authorization


def _anthropic_decode(request: Request, body: bytes) -> dict[str, Any]:
    anthropic_api.check_version(request.header("anthropic-version"))
    translated = anthropic_api.openai_request(body)
    request.scope[STOP_SEQUENCES] = tuple(translated.get("stop") or ())
    return translated


def _anthropic_credential(request: Request) -> str | None:
    """``x-api-key`` (what Anthropic's SDKs send), else ``Authorization: Bearer``:
    the same keys and tenants as the OpenAI routes."""
    key = request.header("x-api-key")
    if key is not None and key.strip():
        return f"Bearer {key.strip()}"
    return request.header("authorization")


OPENAI_CHAT = Dialect(oa.ChatCompletionRequest, "/v1/chat/completions")
OPENAI_COMPLETIONS = Dialect(oa.CompletionRequest, "/v1/completions")
ANTHROPIC_MESSAGES = Dialect(oa.ChatCompletionRequest, "/v1/chat/completions",
                             _anthropic_decode, _anthropic_credential)


def anthropic_errors(handler: Handler) -> Handler:
    """A route whose errors (a bad key, 429, 529 …) are rendered in Anthropic's
    shape; the router still sends them (``errors.AnthropicShaped``)."""
    async def anthropic_route(request: Request) -> None:
        try:
            await handler(request)
        except AnthropicShaped:
            raise
        except HedgerowError as error:
            raise AnthropicShaped(error, request.scope.get("hedgerow.request_id")) from None

    return anthropic_route


class AnthropicSend:
    """An ASGI ``send`` that rewrites the chat path's 200 answer as Anthropic's."""

    def __init__(self, request: Request) -> None:
        self.scope = request.scope
        self.send = request.send
        self._mode = "pass"
        self._held: Message | None = None
        self._parser = SseParser()
        self._stream: MessageStream | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self._start(message)
        elif message["type"] == "http.response.body" and self._mode == "json":
            await self._whole(message)
        elif message["type"] == "http.response.body" and self._mode == "sse":
            await self._events(message)
        else:
            await self.send(message)

    def _stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.scope.get(STOP_SEQUENCES, ()))

    async def _start(self, message: Message) -> None:
        content_type = dict(message.get("headers", [])).get(b"content-type", b"")
        if message.get("status") != 200:
            await self.send(message)
        elif content_type.startswith(b"text/event-stream"):
            self._mode = "sse"
            self._stream = MessageStream(self._stop_sequences())
            await self.send(message)
        else:
            self._mode = "json"  # held until the body, whose length changes
            self._held = message

    async def _whole(self, message: Message) -> None:
        # The chat path sends a whole JSON answer in one body message.
        body = orjson.dumps(message_of(orjson.loads(message.get("body", b"")),
                                       self._stop_sequences()))
        held = self._held or {"type": "http.response.start", "status": 200, "headers": []}
        headers = [(k, v) for k, v in held.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**held, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def _events(self, message: Message) -> None:
        assert self._stream is not None
        raw = message.get("body", b"")
        if raw == HEARTBEAT:
            out = self._stream.heartbeat()
        else:
            out = b"".join(self._translate(event.data) for event in self._parser.feed(raw))
        more = message.get("more_body", False)
        if out or not more:
            await self.send({"type": "http.response.body", "body": out, "more_body": more})

    def _translate(self, data: str) -> bytes:
        assert self._stream is not None
        if data == "[DONE]":
            return self._stream.done()
        return self._stream.chunk(orjson.loads(data))
