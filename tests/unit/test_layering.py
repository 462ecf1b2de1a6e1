"""Which package may import which, read from the source (every import, lazy ones too).

- ``gateway`` never imports ``control_plane``: what both need (the admin token
  helpers, wire types) lives in ``hedgerow``.
- ``workers`` import neither ``gateway`` nor ``control_plane``.
- No runtime package imports test code: twins such as ``worker_mock`` live
  under ``tests/``.
- The processes' runtime (everything ``gateway.main``, ``control_plane.main``
  and ``workers.main`` import, transitively) never imports the command line:
  no ``argparse``, no ``hedgerow.cli*`` or ``*_cli`` module, no launcher.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "control_plane", "workers", "hedgerow", "policies")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, *, runtime_only: bool = False) -> Iterator[str]:
    """Every module ``module`` names in an import statement, anywhere in it
    (``runtime_only``: not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(MODULES[module].read_text())
    skipped: set[int] = set()
    if runtime_only:
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and is_type_checking(node) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            assert node.module is not None
            yield node.module
            # ``from gateway.corridor import embed_route`` names a module too
            yield from (f"{node.module}.{alias.name}" for alias in node.names
                        if f"{node.module}.{alias.name}" in MODULES)


def top(name: str) -> str:
    return name.split(".")[0]


def in_package(package: str) -> list[str]:
    return sorted(m for m in MODULES if top(m) == package)


def offenders(package: str, forbidden: set[str]) -> list[str]:
    return [f"{module} imports {name}" for module in in_package(package)
            for name in imports(module) if top(name) in forbidden]


def test_the_gateway_never_imports_the_control_plane() -> None:
    assert len(in_package("gateway")) > 40
    assert offenders("gateway", {"control_plane"}) == []


def test_workers_import_neither_the_gateway_nor_the_control_plane() -> None:
    assert in_package("workers")
    assert offenders("workers", {"gateway", "control_plane"}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_runtime_package_imports_test_code(package: str) -> None:
    assert offenders(package, {"tests"}) == []


def is_command_line(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return name == "argparse" or (top(name) == "hedgerow" and (
        leaf.startswith("cli") or leaf.endswith("_cli") or leaf == "launcher"))


def runtime_of(entry: str) -> dict[str, str]:
    """Each project module ``entry`` reaches through runtime imports -> who imported it."""
    seen = {entry: entry}
    todo = [entry]
    while todo:
        module = todo.pop()
        for name in imports(module, runtime_only=True):
            # ``import a.b.c`` runs a/__init__ and a/b/__init__ as well
            chain = name.split(".")
            for n in range(1, len(chain) + 1):
                reached = ".".join(chain[:n])
                if (reached in MODULES or reached == "argparse") and reached not in seen:
                    seen[reached] = module
                    if reached in MODULES:
                        todo.append(reached)
    return seen


@pytest.mark.parametrize("entry", ["gateway.main", "control_plane.main", "workers.main"])
def test_the_runtime_never_imports_the_command_line(entry: str) -> None:
    reached = runtime_of(entry)
    assert len(reached) > 10  # the walk follows imports at all
    assert [f"{name} (imported by {by})" for name, by in sorted(reached.items())
            if is_command_line(name)] == []


def test_the_command_line_checks_catch_what_they_look_for() -> None:
    # The walk from the CLI itself must find the CLI: the predicate is not vacuous.
    reached = runtime_of("hedgerow.cli")
    assert {"argparse", "hedgerow.cli_env", "hedgerow.cli_flags"} <= set(reached)
    assert all(is_command_line(n) for n in ("argparse", "hedgerow.key_cli", "hedgerow.launcher"))
