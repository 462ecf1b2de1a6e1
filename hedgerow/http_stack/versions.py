"""The exact hypercorn, aioquic and h2 the patches in this package were written
against, and the check that refuses to serve on any other.

Every module of ``hedgerow.http_stack`` reaches into private code of these
three libraries. A new release may rename a method, change a signature or
move the behaviour a patch relies on, and a patch that silently stops taking
effect is worse than one that fails: so the versions are pinned exactly
(``pyproject.toml``, ``locks/*.txt``) and ``check_versions`` is called at
process start by every role that serves HTTP (gateway, control plane,
worker). On a mismatch it raises ``UntestedHttpStack`` naming the package,
the version found and the one pinned.

Escape hatch, for trying a new release before the patches are re-read:
``HEDGEROW_ALLOW_UNTESTED_HTTP_STACK=1`` turns the refusal into one warning.
To move a pin: re-read every patch module against the new source, run
``tests/unit/test_http_stack_*.py``, then change ``PINNED``, ``pyproject.toml``
and the locks together (``make lock``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version

log = logging.getLogger("hedgerow.http_stack")

PINNED: Mapping[str, str] = {"hypercorn": "0.18.0", "aioquic": "1.7.2", "h2": "4.4.1"}
ESCAPE_HATCH = "HEDGEROW_ALLOW_UNTESTED_HTTP_STACK"


class UntestedHttpStack(RuntimeError):
    """An installed hypercorn/aioquic/h2 is not the version the patches were tested on."""


def _installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def mismatches(installed: Callable[[str], str | None] = _installed) -> list[str]:
    """One line per pinned package installed at another version. A package not
    installed at all is not listed: a role that needs it fails on its import
    (the control plane and workers run without aioquic)."""
    found = {name: installed(name) for name in PINNED}
    return [f"{name} {have} is installed, Hedgerow's HTTP stack is tested on {name}=={PINNED[name]}"
            for name, have in found.items() if have is not None and have != PINNED[name]]


def check_versions(*, environ: Mapping[str, str] = os.environ,
                   installed: Callable[[str], str | None] = _installed) -> None:
    """Refuse to start on an untested hypercorn/aioquic/h2 (``UntestedHttpStack``);
    with ``HEDGEROW_ALLOW_UNTESTED_HTTP_STACK=1`` only warn."""
    found = mismatches(installed)
    if not found:
        return
    detail = "; ".join(found)
    if environ.get(ESCAPE_HATCH) == "1":
        log.warning("%s. Serving anyway (%s=1): the patches in hedgerow.http_stack may "
                    "not take effect on it", detail, ESCAPE_HATCH)
        return
    raise UntestedHttpStack(
        f"{detail}. Hedgerow patches private code of these libraries (hedgerow.http_stack) "
        f"and refuses to serve on versions it was not tested on: install the pinned ones "
        f"(locks/*.txt), or set {ESCAPE_HATCH}=1 to try anyway")
