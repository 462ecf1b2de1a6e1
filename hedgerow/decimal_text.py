"""Strict reading of the decimal numbers that arrive as text from the network.

``str.isdigit()`` is no guard before ``int()``: it is True for ``'²'`` (which
``int`` refuses with ValueError) and for ``'٣'`` (which ``int`` reads as 3);
``int`` also takes signs, underscores and surrounding whitespace, and raises
for more than 4,300 digits. A number in a client's header or a worker's
reply must be plain ASCII digits of bounded length; anything else is refused
by the caller, with the error of its own layer (400 for a client, a malformed
upstream reply for a worker).
"""

from __future__ import annotations

MAX_DIGITS = 18  # below 2**63: every count, length and id Hedgerow reads fits


def parse_decimal(text: str | bytes, *, max_digits: int = MAX_DIGITS) -> int | None:
    """``text`` as a non-negative integer when it is 1 to ``max_digits`` ASCII
    digits and nothing else (no sign, space or underscore); None otherwise."""
    if not 0 < len(text) <= max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)
