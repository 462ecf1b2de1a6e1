"""``hedgerow.gc_tuning``: once startup is done, what it built is frozen and
young collections come 50,000 allocations apart (in a child process: the
test session's own collector is left alone)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json
from hedgerow.gc_tuning import tune_for_serving
built = [{"startup": i} for i in range(5000)]
tune_for_serving()
print(json.dumps([gc.get_threshold(), gc.get_freeze_count()]))
"""


def test_tuning_freezes_startup_objects_and_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    threshold, frozen = json.loads(out)
    assert threshold == [50_000, 20, 100]
    assert frozen >= 5000  # the startup objects no longer walked by any collection


def test_a_gateway_run_inside_another_process_leaves_its_collector_alone() -> None:
    from gateway.main import GatewayOptions

    assert GatewayOptions().tune_gc is False  # only ``hedgerow gateway`` (the CLI) sets it
