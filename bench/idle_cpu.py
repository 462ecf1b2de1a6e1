"""What an idle gateway spends on its own timers: CPU per second with no requests.

A control plane, one simulated worker and one gateway (``--processes 1``),
as ``bench.stack`` starts them; after 5 s to settle, the gateway's utime +
stime (``/proc/PID/stat``, all its threads) over a window with no traffic.
At one stream that idle work is paid by every request (docs/benchmarks.md,
"A clock that sleeps while nothing is queued").

    PYTHONPATH=$PWD .venv/bin/python bench/idle_cpu.py [SECONDS]

Run as a script path to measure another checkout with the same file
(``PYTHONPATH=/path/to/that/tree``).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench.procstat import cpu_seconds
from bench.stack import Stack


def idle_cpu_ms_per_s(window_s: float) -> float:
    stack = Stack(Path(tempfile.mkdtemp(prefix="hedgerow-idle-")))
    try:
        stack.start_control_plane()
        stack.start_worker("w1", "--backend", "sim")
        pid = stack.start_gateway().popen.pid
        time.sleep(5)
        used, started = cpu_seconds(pid), time.monotonic()
        time.sleep(window_s)
        return (cpu_seconds(pid) - used) * 1000 / (time.monotonic() - started)
    finally:
        for proc in reversed(stack.procs):
            proc.stop()


if __name__ == "__main__":
    window = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    print(f"gateway idle CPU: {idle_cpu_ms_per_s(window):.2f} ms per second over {window:.0f} s")
