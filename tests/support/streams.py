"""Clients for the fault tests: streams read in background threads, SSE endings."""

from __future__ import annotations

import ssl
import threading
import time
from dataclasses import dataclass, field

import httpx
import orjson

from gateway.app import prefix_key
from hedgerow import openai_api as oa
from policies.scoring import affinity_weight
from tests.support.stack import Stack

MODEL = "smollm2-135m-instruct"


def client(stack: Stack, *, http2: bool = False, timeout: float = 30) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, timeout=timeout, http2=http2,
                        verify=ssl.create_default_context(cafile=stack.ca_cert))


def chat_body(max_tokens: int, content: str = "hi") -> dict[str, object]:
    return {"model": MODEL, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}


@dataclass
class StreamResult:
    """What one streaming client saw, filled in by its thread."""

    status: int = 0
    worker: str = ""
    text: str = ""
    error: str = ""
    first_byte: threading.Event = field(default_factory=threading.Event)
    finished_at: float = 0.0

    @property
    def done(self) -> bool:
        """Ended with ``data: [DONE]``: the client got the whole answer."""
        return self.text.rstrip().endswith("data: [DONE]")

    def error_event(self) -> dict[str, str] | None:
        """The terminal ``data: {"error": ...}`` event, if the stream ended with one."""
        events = sse_data(self.text)
        if not events or events[-1] == "[DONE]":
            return None
        last = orjson.loads(events[-1])
        return dict(last["error"]) if "error" in last else None


def sse_data(text: str) -> list[str]:
    """The ``data:`` of each SSE event in ``text`` (``id:`` lines and comments skipped)."""
    found: list[str] = []
    for block in text.strip().split("\n\n"):
        data = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            found.append("\n".join(data))
    return found


def stream_in_thread(stack: Stack, body: dict[str, object]) -> tuple[threading.Thread, StreamResult]:
    result = StreamResult()

    def run() -> None:
        try:
            with client(stack) as http, http.stream("POST", "/v1/chat/completions",
                                                     json=body) as response:
                result.status = response.status_code
                result.worker = response.headers.get("x-hedgerow-worker", "")
                for piece in response.iter_text():
                    result.text += piece
                    result.first_byte.set()
        except httpx.HTTPError as error:
            result.error = f"{type(error).__name__}: {error}"
        finally:
            result.finished_at = time.monotonic()
            result.first_byte.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def metric(stack: Stack, line_prefix: str) -> float:
    for line in stack.gateway_metrics().splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def conversation_owned_by(worker_id: str, workers: tuple[str, ...]) -> dict[str, object]:
    """A two-message chat whose prefix-affinity owner is ``worker_id``."""
    for i in range(1000):
        body = {**chat_body(5), "messages": [{"role": "user", "content": f"earlier {i}"},
                                              {"role": "user", "content": "now"}]}
        key = prefix_key(MODEL, oa.ChatCompletionRequest.model_validate(body))
        if key is None:
            raise AssertionError("a two-message chat always has a prefix key")
        if max(workers, key=lambda w: (affinity_weight(key, w), w)) == worker_id:
            return body
    raise AssertionError("no conversation found")
