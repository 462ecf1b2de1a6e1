"""A worker that hangs (SIGSTOP): the policy's timeouts fire, traffic moves.

A stream whose worker freezes mid-way ends with an SSE error event once no
byte came for ``idle_ms``; a request whose worker freezes before its first
token is retried on the other worker after ``ttft_ms``, invisibly; after
``failures_to_open`` such failures the breaker opens and requests go straight
to the healthy worker. The hung worker gets SIGCONT at teardown.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.stack import Proc, Stack
from tests.support.streams import (
    MODEL,
    chat_body,
    conversation_owned_by,
    metric,
    stream_in_thread,
)

pytestmark = pytest.mark.e2e

SIM = ["--backend", "sim", "--slots", "2", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "20"]
WORKERS = ("a-hangs", "b-healthy")
TTFT_MS = 800
IDLE_MS = 800

POLICY = f"""
timeouts: {{ttft_ms: {TTFT_MS}, idle_ms: {IDLE_MS}}}
breaker: {{failures_to_open: 2, open_for_ms: 30000, max_open_for_ms: 30000}}
retries: {{before_first_token: 1}}
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 5000, deadline_ms: 20000}}
tenants:
  - {{name: local, class: interactive}}
models:
  - {{name: {MODEL}}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("hung")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(root)
    try:
        # A long lease: the frozen worker stays registered, so only the
        # gateway's own timeouts and breaker can steer traffic away from it.
        stack.start_control_plane(lease_s=60.0)
        stack.start_worker("a-hangs", *SIM)
        stack.start_worker("b-healthy", *SIM)
        stack.start_gateway("--policy", str(policy), "--drain-timeout-s", "1")
        yield stack
    finally:
        hung = _proc(stack, "a-hangs")
        if hung.popen.poll() is None:
            os.kill(hung.popen.pid, signal.SIGCONT)
        stack.stop_all()


def _proc(stack: Stack, name: str) -> Proc:
    return next(p for p in stack.procs if p.name == name)


def test_hung_worker_ends_its_streams_then_loses_its_traffic(stack: Stack) -> None:
    # Mid-stream: a conversation a-hangs owns (prefix affinity) streams from it.
    long = {**conversation_owned_by("a-hangs", WORKERS), "max_tokens": 200}
    thread, frozen = stream_in_thread(stack, long)
    assert frozen.first_byte.wait(10)
    assert frozen.worker == "a-hangs"
    time.sleep(0.2)
    os.kill(_proc(stack, "a-hangs").popen.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    thread.join(10)
    error = frozen.error_event()
    assert frozen.status == 200 and error is not None, frozen.text[-300:]
    assert error["code"] == "upstream_timeout"
    assert IDLE_MS / 1000 - 0.1 <= frozen.finished_at - stopped_at < IDLE_MS / 1000 + 2

    # Before the first token: retried on b-healthy once ttft_ms has passed.
    # (A conversation whose prefix a-hangs owns, so it is routed there first.)
    started = time.monotonic()
    thread, retried = stream_in_thread(stack, conversation_owned_by("a-hangs", WORKERS))
    thread.join(10)
    assert (retried.status, retried.worker, retried.done) == (200, "b-healthy", True)
    assert time.monotonic() - started >= TTFT_MS / 1000
    assert metric(stack, "hedgerow_retries_total") >= 1

    # Two failures: the breaker is open and traffic goes straight to b-healthy.
    assert metric(stack, 'hedgerow_breaker_state{state="open",worker="a-hangs"}') == 1
    for i in range(3):
        started = time.monotonic()
        thread, served = stream_in_thread(stack, chat_body(5, f"after {i}"))
        thread.join(10)
        assert (served.status, served.worker, served.done) == (200, "b-healthy", True)
        assert time.monotonic() - started < TTFT_MS / 1000
