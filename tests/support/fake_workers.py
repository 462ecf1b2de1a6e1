"""In-memory workers behind a ``tests.support.worker_mock.MockTransport``: the upstream twin.

Each fake worker answers ``POST .../v1/chat/completions`` the way a real one
streams (role chunk, content chunks, finish chunk, usage chunk, ``[DONE]``),
with a ``Behaviour`` that says how slow it is and how it fails. Every request
is recorded as a ``WorkerCall``: when it arrived, and whether the gateway hung
up before the worker was done (cancellation reached the worker), whether the
wait was for the response headers or in the middle of the token stream.

Worker ``w`` lives at ``http://w.worker.test:8000``; ``record(...)`` builds its
registry entry.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from gateway.upstream.http1 import ConnectFailed, ConnectionBroken
from tests.support.worker_mock import MockReply, MockTransport, WorkerRequest
from hedgerow import openai_api as oa
from hedgerow.asgi import SSE_DONE, sse_event
from hedgerow.wire import WorkerKind, WorkerLoad, WorkerRecord, WorkerRegistration


@dataclass
class Behaviour:
    """How a fake worker answers; change it between requests to change the worker."""

    headers_after_s: float = 0.0  # before the response starts (a real worker: at its first token)
    first_token_after_s: float = 0.0  # after the role chunk, before the first content chunk
    token_gap_s: float = 0.0
    tokens: tuple[str, ...] = ("Hello", ",", " world")
    refuse_connection: bool = False  # the handler raises ConnectFailed
    status: int = 200  # 4xx: an OpenAI error body; 5xx: a server error
    body: bytes | None = None  # the whole answer instead (any status): a body of our choosing
    break_after_tokens: int | None = None  # ConnectionBroken after this many content chunks
    end_after_tokens: int | None = None  # a clean end (no finish, no [DONE]) after this many
    garbage_after_tokens: int | None = None  # ``garbage`` after this many content chunks
    garbage: bytes = b"data: \xff\xfe\n\n"  # default: an event that is not UTF-8
    hold: anyio.Event | None = None  # wait for this before the first content chunk


@dataclass
class WorkerCall:
    worker_id: str
    request_id: str
    body: dict[str, Any]
    arrived: float  # anyio.current_time()
    completed: bool = False  # the worker sent its whole stream
    hung_up: bool = False  # the gateway closed before the worker had finished
    headers: dict[str, str] = field(default_factory=dict)  # as the gateway sent them


def url_of(worker_id: str) -> str:
    return f"http://{worker_id}.worker.test:8000"


def record(worker_id: str, *, model: str, slots: int = 4, kind: WorkerKind = "cpu",
           load: WorkerLoad | None = None) -> WorkerRecord:
    registration = WorkerRegistration(worker_id=worker_id, url=url_of(worker_id), kind=kind,
                                      models=(model,), slots=slots)
    return WorkerRecord(registration=registration, load=load or WorkerLoad(),
                        lease_expires_in_s=30.0)


class TokenStream:
    """One response body, produced as slowly and as brokenly as the behaviour says."""

    def __init__(self, call: WorkerCall, behaviour: Behaviour, model: str) -> None:
        self.call = call
        self.behaviour = behaviour
        self.model = model

    async def __aiter__(self) -> AsyncIterator[bytes]:
        b, rid = self.behaviour, self.call.request_id
        yield sse_event(oa.chat_chunk(rid, self.model, 0, {"role": "assistant", "content": ""}))
        await anyio.sleep(b.first_token_after_s)
        if b.hold is not None:
            await b.hold.wait()
        for index, token in enumerate(b.tokens):
            if index:
                await anyio.sleep(b.token_gap_s)
            if index == b.break_after_tokens:
                raise ConnectionBroken("connection reset by worker")
            if index == b.end_after_tokens:
                return
            if index == b.garbage_after_tokens:
                yield b.garbage
            yield sse_event(oa.chat_chunk(rid, self.model, 0, {"content": token}))
        yield sse_event(oa.chat_chunk(rid, self.model, 0, {}, "stop"))
        used = oa.usage(7, len(b.tokens))
        yield sse_event(oa.usage_chunk(rid, self.model, 0, used))
        yield SSE_DONE
        self.call.completed = True

    async def aclose(self) -> None:
        if not self.call.completed:
            self.call.hung_up = True


@dataclass
class FakeWorkers:
    behaviours: dict[str, Behaviour]
    calls: list[WorkerCall] = field(default_factory=list)

    def transport(self) -> MockTransport:
        return MockTransport(self.handle)

    def calls_to(self, worker_id: str) -> list[WorkerCall]:
        return [c for c in self.calls if c.worker_id == worker_id]

    def calls_for(self, request_id: str) -> list[WorkerCall]:
        return [c for c in self.calls if c.request_id == request_id]

    async def handle(self, request: WorkerRequest) -> MockReply:
        worker_id = request.host.split(".")[0]
        body = orjson.loads(request.body)
        call = WorkerCall(worker_id, request.headers["x-request-id"], body, anyio.current_time(),
                          headers=dict(request.headers))
        self.calls.append(call)
        behaviour = self.behaviours[worker_id]
        if behaviour.refuse_connection:
            raise ConnectFailed("connection refused")
        try:
            await anyio.sleep(behaviour.headers_after_s)
        except anyio.get_cancelled_exc_class():
            call.hung_up = True
            raise
        if behaviour.body is not None:
            return MockReply(behaviour.status, {"content-type": "text/plain"}, behaviour.body)
        if behaviour.status != 200:
            return _error_response(behaviour.status)
        headers = {"content-type": "text/event-stream", "x-request-id": call.request_id}
        return MockReply(200, headers, TokenStream(call, behaviour, body["model"]))


def _error_response(status: int) -> MockReply:
    if status >= 500:
        return MockReply(status, {"content-type": "text/plain"}, b"internal error")
    envelope = {"error": {"message": "max_tokens is too large for this model",
                          "type": "invalid_request_error", "param": "max_tokens",
                          "code": "invalid_value"}}
    return MockReply(status, {"content-type": "application/json"}, orjson.dumps(envelope))
