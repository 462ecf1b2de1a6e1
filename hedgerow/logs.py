"""Logging set-up shared by every process kind."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # hypercorn's per-connection chatter is noise at info level.
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
