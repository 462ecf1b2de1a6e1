"""A gateway with a small connection cap (``--max-connections``), semantic cache off."""

from __future__ import annotations

from pathlib import Path

from bench.shipped_policy import shipped_policy_text
from tests.support.stack import Stack

SIM = ["--backend", "sim", "--slots", "8", "--sim-prefill-ms-per-token", "0.1",
       "--sim-decode-ms-per-token", "2"]


def start_capped_stack(root: Path, cap: int, *extra: str) -> Stack:
    """Control plane, one simulated worker and a gateway capped at ``cap``
    connections; the caller stops it (``stack.stop_all()``)."""
    policy = root / "policy.yaml"
    policy.write_text(shipped_policy_text({"semantic": {"enabled": False}}))
    stack = Stack(root)
    try:
        stack.start_control_plane()
        stack.start_worker("sim-1", *SIM)
        stack.start_gateway(*extra, "--policy", str(policy), "--max-connections", str(cap))
    except BaseException:
        stack.stop_all()
        raise
    return stack
