"""How a patch is applied: checked, once, passing arguments through, undoable."""

from __future__ import annotations

import types
from typing import Any

import pytest

from hedgerow.http_stack import applied
from hedgerow.http_stack.patch import PatchError, original, replace, require, undo, wrap


class Library:
    def method(self, a: int, *, b: int = 0) -> tuple[int, int]:
        return a, b


def _doubling(method: Any) -> Any:
    def doubled(self: Any, *args: Any, **kwargs: Any) -> tuple[int, int]:
        a, b = method(self, *args, **kwargs)
        return 2 * a, 2 * b
    return doubled


def test_a_missing_attribute_fails_at_install_naming_it() -> None:
    with pytest.raises(PatchError, match=r"http_stack\.demo .*Library has no _gone"):
        require(Library, "method", "_gone", patch="demo")
    with pytest.raises(PatchError):
        wrap(Library, "_gone", _doubling, patch="demo")
    assert "demo" not in applied()


def test_wrap_applies_once_passes_arguments_through_and_undoes() -> None:
    try:
        assert wrap(Library, "method", _doubling, patch="demo")
        assert not wrap(Library, "method", _doubling, patch="demo")  # not stacked
        assert Library().method(1, b=3) == (2, 6)
        assert original("demo", Library, "method")(Library(), 1) == (1, 0)
        assert applied()["demo"] == ["Library.method"]
    finally:
        undo("demo")
    assert Library().method(1, b=3) == (1, 3)
    assert "method" in vars(Library)


def test_replace_swaps_a_module_global_and_undo_restores_it() -> None:
    module = types.ModuleType("library")
    module.Thing = int  # type: ignore[attr-defined]
    try:
        assert replace(module, "Thing", float, patch="demo")
        assert module.Thing is float  # type: ignore[attr-defined]
    finally:
        undo("demo")
    assert module.Thing is int  # type: ignore[attr-defined]
