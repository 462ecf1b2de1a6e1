"""The upstream-hop micro-benchmark reads whole worker streams through the real client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from bench import upstream_hop


def test_a_short_run_reads_every_stream_whole() -> None:
    # ``measure`` raises on a stream with the wrong number of events; the
    # script runs it against its worker-shaped server in a child process.
    root = str(Path(upstream_hop.__file__).resolve().parents[1])  # this checkout first
    path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    run = subprocess.run([sys.executable, upstream_hop.__file__, "20", "2", "3"],
                         capture_output=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path})
    result = orjson.loads(run.stdout.splitlines()[-1])
    assert (result["streams"], result["requests"], result["tokens"]) == (2, 20, 3)
    assert result["cpu_ms_per_request"] > 0


def test_the_worker_events_are_chunks_of_sse_events() -> None:
    framed = upstream_hop.events(2)
    assert len(framed) == 6  # role, two tokens, finish, usage, [DONE]
    size, _, rest = framed[1].partition(b"\r\n")
    assert int(size, 16) == len(rest) - 2 and rest.startswith(b"data: ")
    assert framed[-1].endswith(b"data: [DONE]\n\n\r\n")
