"""A worker SIGKILLed mid-stream.

Clients already streaming from it get a terminal SSE error event, never a
clean end; requests still waiting in the gateway's queue are served by the
other worker. Both workers have one slot, so with two long streams running
the next requests must wait; the killed worker's breaker opens on the broken
stream (failures_to_open: 1) so the waiting requests are not sent to it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.stack import Stack
from tests.support.streams import MODEL, chat_body, stream_in_thread

pytestmark = pytest.mark.e2e

SIM = ["--backend", "sim", "--slots", "1", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "20"]

POLICY = f"""
breaker: {{failures_to_open: 1, open_for_ms: 30000, max_open_for_ms: 30000}}
hedging: {{enabled: false}}
anonymous_tenant: local
classes:
  - {{name: interactive, ttft_slo_ms: 8000, deadline_ms: 20000}}
tenants:
  - {{name: local, class: interactive}}
models:
  - {{name: {MODEL}}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("killed")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    stack = Stack(root)
    try:
        stack.start_control_plane(lease_s=30.0)
        stack.start_worker("a-doomed", *SIM)
        stack.start_worker("b-survivor", *SIM)
        stack.start_gateway("--policy", str(policy), "--drain-timeout-s", "1")
        yield stack
    finally:
        stack.stop_all()


def test_streams_on_a_killed_worker_end_with_an_error_and_queued_requests_move(
        stack: Stack) -> None:
    # One long stream on each worker (both have one slot).
    doomed_thread, doomed = stream_in_thread(stack, chat_body(150, "long one"))
    assert doomed.first_byte.wait(10)
    survivor_thread, survivor = stream_in_thread(stack, chat_body(60, "long two"))
    assert survivor.first_byte.wait(10)
    assert {doomed.worker, survivor.worker} == {"a-doomed", "b-survivor"}
    queued = [stream_in_thread(stack, chat_body(5, f"queued {i}")) for i in range(3)]
    time.sleep(0.3)  # both slots are busy: these wait in the gateway's queue
    assert not any(result.first_byte.is_set() for _, result in queued)

    next(p for p in stack.procs if p.name == doomed.worker).stop(signal.SIGKILL)

    doomed_thread.join(10)
    assert doomed.status == 200 and not doomed.done, doomed.text[-300:]
    error = doomed.error_event()
    assert error is not None, f"stream ended without an error event: {doomed.text[-300:]!r}"
    assert error["code"].startswith("upstream")
    survivor_thread.join(15)
    assert survivor.done
    for thread, result in queued:
        thread.join(15)
        assert (result.status, result.worker, result.done) == (200, survivor.worker, True), (
            result.status, result.text[-300:], result.error)

    # And new requests keep being served, by the survivor alone.
    for i in range(2):
        thread, result = stream_in_thread(stack, chat_body(5, f"after {i}"))
        thread.join(10)
        assert (result.status, result.worker, result.done) == (200, survivor.worker, True)
