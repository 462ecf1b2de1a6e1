"""A worker whose reply has an odd Content-Length ('²', 5,000 digits, two
lengths, TE with CL): the gateway's HTTP/1.1 client refuses the reply as
malformed, never crashes, and the request is retried on a healthy worker, so
the client gets its answer.

The odd worker is a raw socket server, declared in the policy as an external
upstream for the same model as a simulated worker.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.support.stack import Stack, free_port, wait_for
from tests.support.streams import client

pytestmark = pytest.mark.e2e

MODEL = "odd-model"
SIM = ["--backend", "sim", "--slots", "4", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "1", "--sim-output-tokens", "4", "--model-name", MODEL]
ODD_FRAMINGS = [b"content-length: \xb2\r\n", b"content-length: " + b"9" * 5000 + b"\r\n",
                b"content-length: 2\r\ncontent-length: 3\r\n",
                b"transfer-encoding: chunked\r\ncontent-length: 2\r\n"]


class OddWorker(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    completions = 0


class _Handler(socketserver.StreamRequestHandler):
    server: OddWorker

    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = self.request.recv(65536)
            if not data:
                return
            head += data
        if head.startswith(b"GET"):  # the control plane's health probe
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
            return
        framing = ODD_FRAMINGS[self.server.completions % len(ODD_FRAMINGS)]
        self.server.completions += 1
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + framing
                         + b"\r\ndata: [DONE]\n\n")


@pytest.fixture(scope="module")
def odd_worker() -> Iterator[OddWorker]:
    server = OddWorker(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, odd_worker: OddWorker) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("odd-reply")
    port = odd_worker.server_address[1]
    (root / "policy.yaml").write_text(f"""
anonymous_tenant: local
hedging: {{enabled: false}}
classes:
  - {{name: interactive, ttft_slo_ms: 5000, deadline_ms: 20000}}
tenants:
  - {{name: local, class: interactive}}
models:
  - {{name: {MODEL}}}
upstreams:
  - {{name: odd, url: "http://127.0.0.1:{port}", models: [{MODEL}], probe_interval_ms: 300}}
""")
    stack = Stack(root)
    try:
        stack.start_control_plane(policy=root / "policy.yaml")
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway()
        wait_for(lambda: stack.worker("odd") is not None, "the odd upstream to be listed", 10)
        yield stack
    finally:
        stack.stop_all()


def test_an_odd_content_length_from_a_worker_is_retried_elsewhere(
        stack: Stack, odd_worker: OddWorker) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with client(stack, timeout=20) as http:
        wait_for(lambda: http.get("/readyz").json()["workers"] == 2,
                 "the gateway to know both workers", 10)
        answers = [http.post("/v1/chat/completions",
                             json={**body, "stream": i % 2 == 0,
                                   "messages": [{"role": "user", "content": f"hi {i}"}]})
                   for i in range(12)]
    assert [a.status_code for a in answers] == [200] * 12, [a.text[:200] for a in answers]
    assert {a.headers["x-hedgerow-worker"] for a in answers} == {"sim-1"}
    assert odd_worker.completions >= 2  # the odd worker was tried, and its replies refused
    gateway = next(p for p in stack.procs if p.name == "gateway")
    log = gateway.log()
    assert "upstream_malformed" in log or "malformed" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
