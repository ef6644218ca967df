"""``module:NAME`` references, as ``--schema``, ``--source`` and ``--model`` take them: the
user's own code, imported from the current directory as with ``python -m``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from stagefeed.common.errors import ConfigError


def import_ref(ref: str, flag: str) -> Any:
    """The object ``module:attr`` names, the current directory importable as with ``python -m``.

    Any failure is a ``ConfigError`` naming ``flag`` and ``ref`` in one line.
    """
    module_name, _, attr = ref.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a user module may raise anything on import
        raise ConfigError(
            f"{flag} {ref!r} cannot be imported: {type(exc).__name__}: {exc}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{flag} {ref!r}: module {module_name!r} has no {attr!r}") from None
