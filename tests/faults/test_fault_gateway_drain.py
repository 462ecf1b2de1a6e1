"""Graceful drain: SIGTERM to a gateway with streams in flight.

The gateway stops accepting at once: its listeners close, and a new stream
on an HTTP/2 connection already open is refused with REFUSED_STREAM (safe to
retry) before the app sees it, while the streams already running carry on. A request that does reach the app gets 503 ``gateway_draining`` with
Retry-After, and /readyz answers 503 -- both checked in-process below. A stream that finishes within ``--drain-timeout-s`` ends with
``[DONE]``; one still running at the deadline ends with an SSE error event
(``gateway_draining``), never a cut connection; one still waiting for its
first token then gets 503 ``gateway_draining``; and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import time
from collections.abc import Iterator

from typing import cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import orjson
import pytest

from gateway.app import GatewayApp
from gateway.corridor.dispatch import Dispatcher
from gateway.corridor.scheduling import SchedulerDoor
from hedgerow.asgi import Message
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.schema import DEFAULT_POLICY_PATH, load_policy
from tests.support.stack import Proc, Stack, wait_for
from tests.support.streams import (
    MODEL,
    chat_body,
    client,
    stream_in_thread,
)

pytestmark = pytest.mark.e2e

SIM = ["--backend", "sim", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "20"]
DRAIN_S = 2.0
# A TTFT timeout longer than the drain: a request on the frozen worker is still
# waiting for its first token when the deadline comes. Its connection's mutual-TLS
# handshake never completes either (the worker is stopped), so the connect timeout,
# which covers the handshake, outlasts the drain as well.
POLICY = f"""
timeouts: {{ttft_ms: 20000, connect_ms: 20000}}
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 20000, deadline_ms: 30000}}
tenants:
  - {{name: local, class: interactive}}
models:
  - {{name: {MODEL}}}
"""


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Proc]]:
    root = tmp_path_factory.mktemp("drain")
    (root / "policy.yaml").write_text(POLICY)
    stack = Stack(root)
    try:
        stack.start_control_plane(lease_s=30.0)
        # Fewer slots and a later id: z-frozen ranks last while b-live has room.
        stack.start_worker("b-live", "--slots", "2", *SIM)
        frozen = stack.start_worker("z-frozen", "--slots", "1", *SIM)
        gateway = stack.start_gateway("--drain-timeout-s", str(DRAIN_S),
                                      "--policy", str(root / "policy.yaml"))
        with client(stack) as http:
            wait_for(lambda: http.get("/readyz").json()["workers"] == 2,
                     "the gateway to know both workers", 10)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        yield stack, gateway
    finally:
        frozen.stop(signal.SIGKILL)  # a stopped process still dies of SIGKILL
        stack.stop_all()


def _last_event_data(text: str) -> str:
    """The data of the stream's last event (an event from the stream's log
    carries an ``id:`` line too: the cut may come from it or from the app)."""
    last = text.strip().split("\n\n")[-1]
    return "".join(line[len("data: "):] for line in last.split("\n")
                   if line.startswith("data: "))


def test_sigterm_finishes_short_streams_and_ends_long_ones_with_an_error_event(
        stack: tuple[Stack, Proc]) -> None:
    stack_, gateway = stack
    short_thread, short = stream_in_thread(stack_, chat_body(40, "short"))  # about 0.8 s
    with client(stack_, http2=True) as h2:
        with h2.stream("POST", "/v1/chat/completions", json=chat_body(500, "long")) as long:
            assert long.http_version == "HTTP/2" and long.status_code == 200
            chunks = long.iter_text()
            text = next(chunks)
            assert short.first_byte.wait(5)
            assert (short.worker, long.headers["x-hedgerow-worker"]) == ("b-live", "b-live")
            # b-live is full, so the next request goes to z-frozen: no first token, ever.
            waiting_thread, waiting = stream_in_thread(stack_, chat_body(5, "waits"))
            time.sleep(0.3)

            gateway.popen.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)
            # New connections are not accepted at all.
            with pytest.raises(httpx.ConnectError), client(stack_) as fresh:
                fresh.get("/healthz")

            text += "".join(chunks)
            ended_after = time.monotonic() - signalled
    short_thread.join(10)
    waiting_thread.join(10)
    assert waiting.status == 503, (waiting.status, waiting.text)
    assert orjson.loads(waiting.text)["error"]["code"] == "gateway_draining"
    assert DRAIN_S - 0.2 <= waiting.finished_at - signalled < DRAIN_S + 2
    assert short.status == 200 and short.done, short.text[-200:]
    last = _last_event_data(text)
    assert last.startswith("{"), text[-300:]
    assert orjson.loads(last)["error"]["code"] == "gateway_draining", last
    assert DRAIN_S - 0.2 <= ended_after < DRAIN_S + 2
    assert gateway.popen.wait(10) == 0


@pytest.mark.anyio
async def test_a_draining_app_is_not_ready_and_refuses_new_completions() -> None:
    app = GatewayApp(load_policy(DEFAULT_POLICY_PATH), LatestValue(RegistrySnapshot(version=0), -1),
                     scheduler=cast(SchedulerDoor, None), dispatcher=cast(Dispatcher, None))
    app.drain.begin()
    status, headers, body = await _call(app, "GET", "/readyz")
    assert status == 503 and orjson.loads(body)["draining"] is True
    status, headers, body = await _call(app, "POST", "/v1/chat/completions",
                                        orjson.dumps(chat_body(5)))
    assert status == 503
    assert orjson.loads(body)["error"]["code"] == "gateway_draining"
    assert int(headers[b"retry-after"]) >= 1


async def _call(app: GatewayApp, method: str, path: str,
                body: bytes = b"") -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {"type": "http", "method": method, "path": path, "headers": [],
             "query_string": b"", "http_version": "1.1"}
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return (sent[0]["status"], dict(sent[0]["headers"]),
            b"".join(m.get("body", b"") for m in sent[1:]))


class RawH2:
    """One HTTP/2 connection driven frame by frame, to see the server's error codes."""

    def __init__(self, stack_: Stack) -> None:
        context = ssl.create_default_context(cafile=stack_.ca_cert)
        context.set_alpn_protocols(["h2"])
        port = int(stack_.gateway_url.rsplit(":", 1)[1])
        self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), 5),
                                        server_hostname="127.0.0.1")
        self.sock.settimeout(5)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.flush()

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def post(self, body: dict[str, object]) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        data = orjson.dumps(body)
        self.conn.send_headers(stream_id, [
            (":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "https"),
            (":authority", "127.0.0.1"), ("content-type", "application/json"),
            ("content-length", str(len(data)))])
        self.conn.send_data(stream_id, data, end_stream=True)
        self.flush()
        return stream_id

    def until(self, wanted: type, stream_id: int) -> h2.events.Event:
        while True:
            for event in self.conn.receive_data(self.sock.recv(65536)):
                if isinstance(event, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                        event.stream_id)
                if isinstance(event, wanted) and getattr(event, "stream_id", None) == stream_id:
                    self.flush()
                    return event
            self.flush()


def test_a_new_http2_stream_during_the_drain_is_refused_as_safe_to_retry(
        stack: tuple[Stack, Proc]) -> None:
    stack_, gateway = stack
    raw = RawH2(stack_)
    long = raw.post(chat_body(500, "long"))  # ~10 s of tokens on b-live
    raw.until(h2.events.DataReceived, long)
    gateway.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    late = raw.post(chat_body(5, "late"))
    reset = raw.until(h2.events.StreamReset, late)
    assert reset.error_code == h2.errors.ErrorCodes.REFUSED_STREAM  # not processed: retry
    raw.until(h2.events.DataReceived, long)  # the stream already running carries on
    raw.sock.close()
    assert gateway.popen.wait(15) == 0
