"""Hugging Face ``datasets`` for the tests of ``stagefeed.HFRecords``, from beside the venv.

The Makefile installs ``datasets`` (and pandas with it) in ``.venv/hf-packages``, not in the
venv: Keras imports pandas whenever it is installed, and every TensorFlow process paid about
half a second of CPU for it. ``use()`` puts that folder at the *end* of ``sys.path``, so the
venv's own numpy and pyarrow still come first, and returns the ``datasets`` module.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

HF_DIR = os.path.join(sys.prefix, "hf-packages")


def use() -> types.ModuleType:
    """``datasets``, imported from ``HF_DIR``; ``AssertionError`` if ``make venv`` did not put
    it there (a missing reader must fail its tests, not skip them)."""
    assert os.path.isdir(HF_DIR), f"{HF_DIR} is missing: make venv installs it"
    if HF_DIR not in sys.path:
        sys.path.append(HF_DIR)
    os.environ.setdefault("USE_TF", "0")  # datasets would import TensorFlow into the producer
    return importlib.import_module("datasets")
