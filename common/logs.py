"""Logging set-up shared by every process stagefeed starts."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Log to stderr; quiet the chatty libraries."""
    root = logging.getLogger()
    if not any(getattr(h, "_stagefeed", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._stagefeed = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
