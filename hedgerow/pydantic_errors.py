"""A pydantic ``ValidationError`` as the 400 a client reads: the field's path, no type tags."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from hedgerow.errors import InvalidRequest

MAX_PARAM_SHOWN = 64


def invalid_value(error: ValidationError) -> InvalidRequest:
    """``InvalidRequest`` naming the field at fault. Of a union's failures
    (a string, or a list of blocks) the deepest one says the most."""
    errors = error.errors()
    # The last of the deepest: a union's later member (the list) over its first (a string).
    worst = max(reversed(errors), key=lambda e: len(e["loc"]))
    param = param_of(worst["loc"])[:MAX_PARAM_SHOWN] or None
    message = f"invalid value for {param!r}: {worst['msg']}" if param else worst["msg"]
    return InvalidRequest(message, param=param, code="invalid_value")


def param_of(loc: Sequence[int | str]) -> str:
    """``messages.0.content.1.text``: without pydantic's union member tags
    (``str``, ``list[...]``) and a tagged union's tag after a list index."""
    parts: list[str] = []
    for index, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(str(part))
            continue
        if part in ("str", "constrained-str") or "[" in part:
            continue
        after_tagged = (index >= 2 and isinstance(loc[index - 1], int)
                        and "tagged-union[" in str(loc[index - 2]))
        if not after_tagged:
            parts.append(part)
    return ".".join(parts)
