"""Outside ``hedgerow.http_stack`` nothing assigns into hypercorn, aioquic or h2:
every patch of their internals is in that one package, with its checks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("hypercorn", "aioquic", "h2")
PACKAGES = ("gateway", "hedgerow", "control_plane", "workers", "policies", "bench")
PATCHES = ROOT / "hedgerow" / "http_stack"
# Measurement, not serving: counters wrapped around hypercorn in a benchmark's
# own server process.
INSTRUMENTATION = {ROOT / "bench" / "h2_flushes.py"}


def _library_names(tree: ast.Module) -> set[str]:
    """Names bound to a library module or to something imported from one."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patches_outside(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    library = _library_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args):
            targets = [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
        for target in targets:
            if isinstance(target, ast.Attribute) and _root(target) in library:
                found.append(f"{path}:{node.lineno}")
    return found


def test_no_module_outside_the_http_stack_patches_the_libraries() -> None:
    sources = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
               if PATCHES not in path.parents and path not in INSTRUMENTATION]
    assert len(sources) > 50
    assert [hit for path in sources for hit in patches_outside(path)] == []


def test_the_scan_sees_a_patch(tmp_path: Path) -> None:
    # The check itself: a module global swapped, a method replaced, a setattr;
    # an instance's own attribute is not a patch.
    probe = tmp_path / "probe.py"
    probe.write_text("import hypercorn.asyncio.run\nfrom hypercorn.protocol.h2 import H2Protocol\n"
                     "hypercorn.asyncio.run.asyncio = None\nH2Protocol.handle = None\n"
                     "setattr(H2Protocol, 'x', 1)\nprotocol = H2Protocol\nprotocol.y = 2\n")
    assert [hit.rsplit(":", 1)[1] for hit in patches_outside(probe)] == ["3", "4", "5"]
