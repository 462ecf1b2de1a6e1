"""Which optional dependencies each command needs, checked before it starts.

Hedgerow installs per role (pyproject.toml's extras; docs/deployment.md): the
base is the control plane and the CLI, and a gateway or a worker adds its own
libraries. A command whose role is not installed stops at once with one line
naming the extra to install, instead of a traceback from deep inside an import.
``find_spec`` locates a module without importing it, so the check costs
microseconds and loads nothing.

The semantic cache's embedder (``hedgerow[cache]``) is not required here: a
gateway without it serves with the semantic cache off and says so once
(``gateway.cache.embed_server``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Need:
    module: str  # what the code imports
    distribution: str  # what pip installs
    extra: str  # the extra of hedgerow that brings it


GATEWAY = (Need("aioquic", "aioquic", "gateway"), Need("numpy", "numpy", "gateway"),
           Need("faiss", "faiss-cpu", "gateway"))
WORKER = (Need("llama_cpp", "llama-cpp-python", "worker"), Need("numpy", "numpy", "worker"))
BENCH = (Need("aioquic", "aioquic", "bench"), Need("numpy", "numpy", "bench"))


def needs(command: str, backend: str | None = None) -> tuple[Need, ...]:
    """What ``hedgerow COMMAND`` imports beyond the base install."""
    if command == "gateway":
        return GATEWAY
    if command == "worker":
        return WORKER if backend != "sim" else ()  # the simulated model needs no llama.cpp
    if command == "up":  # a control plane, a gateway and a llama.cpp worker
        return GATEWAY + WORKER
    if command == "bench":
        return BENCH
    return ()


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package counts as missing
        return False


def missing_extras(command: str, backend: str | None = None) -> str | None:
    """One line saying what to install, or None when everything is there."""
    missing = [n for n in needs(command, backend) if not _installed(n.module)]
    if not missing:
        return None
    names = ", ".join(dict.fromkeys(n.distribution for n in missing))
    extras = ",".join(dict.fromkeys(n.extra for n in missing))
    return (f"hedgerow {command} needs {names}, which {'is' if ', ' not in names else 'are'} "
            f"not installed: pip install 'hedgerow[{extras}]'")
