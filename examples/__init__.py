"""Runnable examples; each is also run by the test suite (tests/test_dataset_examples.py)."""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_directory(run: Callable[[str], T]) -> T:
    """``run(directory)`` for an example's ``main``: the directory named on the command line,
    or a temporary one removed afterwards. Logs INFO lines to stderr."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run(directory)
