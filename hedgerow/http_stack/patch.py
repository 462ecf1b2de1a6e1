"""How a patch in ``hedgerow.http_stack`` is applied: checked, once, reversibly.

Every patch module applies itself through these three calls, never by
assigning into hypercorn or aioquic directly:

- ``require(owner, *names, patch=...)``: the attributes a patch reaches into
  exist, or ``PatchError`` now, at start (not an ``AttributeError`` in the
  middle of a request after an upgrade).
- ``wrap(owner, name, make, patch=...)``: ``owner.name`` becomes
  ``make(original)``, once per process (a second call is a no-op); the
  wrapper is written ``(self, *args, **kwargs)`` and passes them through, so
  a parameter added upstream does not break it.
- ``replace(owner, name, value, patch=...)``: a module global or class
  attribute swapped for another (once; the original kept).

``APPLIED`` records what each patch changed (for ``hedgerow.http_stack.applied``
and the tests); ``undo(patch)`` puts the originals back (tests only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# patch name -> [(owner, attribute, what it resolved to, what the owner itself
# held: _MISSING when inherited)], in the order applied.
APPLIED: dict[str, list[tuple[Any, str, Any, Any]]] = {}
_MISSING = object()


class PatchError(RuntimeError):
    """A patch cannot be applied: what it reaches into is not there."""


def _owner_name(owner: Any) -> str:
    return str(getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner)))


def require(owner: Any, *names: str, patch: str) -> None:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        module = getattr(owner, "__module__", None) or _owner_name(owner)
        raise PatchError(
            f"hedgerow.http_stack.{patch} cannot be applied: {module}.{_owner_name(owner)} has "
            f"no {', '.join(missing)} (the library's internals moved: re-read the patch "
            f"against this version, see hedgerow/http_stack/versions.py)")


def is_applied(patch: str, owner: Any, name: str) -> bool:
    return any(o is owner and n == name for o, n, _, _ in APPLIED.get(patch, ()))


def original(patch: str, owner: Any, name: str) -> Any:
    """What ``owner.name`` was before ``patch`` changed it."""
    for o, n, value, _ in APPLIED.get(patch, ()):
        if o is owner and n == name:
            return value
    raise KeyError(f"{patch} has not changed {_owner_name(owner)}.{name}")


def replace(owner: Any, name: str, value: Any, *, patch: str) -> bool:
    """Set ``owner.name = value`` once for ``patch``; False if already done."""
    require(owner, name, patch=patch)
    if is_applied(patch, owner, name):
        return False
    own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    APPLIED.setdefault(patch, []).append((owner, name, getattr(owner, name), own))
    setattr(owner, name, value)
    return True


def wrap(owner: Any, name: str, make: Callable[[Any], Any], *, patch: str) -> bool:
    """``owner.name = make(original)`` once for ``patch``; False if already done."""
    require(owner, name, patch=patch)
    if is_applied(patch, owner, name):
        return False
    current = getattr(owner, name)
    wrapper = make(current)
    try:
        wrapper.__wrapped__ = current
        wrapper.__qualname__ = f"{_owner_name(owner)}.{name}"
        wrapper.__doc__ = f"Patched by hedgerow.http_stack.{patch}."
    except (AttributeError, TypeError):
        pass
    return replace(owner, name, wrapper, patch=patch)


def undo(patch: str) -> None:
    """Put back what ``patch`` changed, latest first (for tests)."""
    for owner, name, _, own in reversed(APPLIED.pop(patch, [])):
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)
