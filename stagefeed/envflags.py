"""Flags that also read ``STAGEFEED_*`` environment variables (same meaning, same checks).

``--queue-mb`` reads ``STAGEFEED_QUEUE_MB``; a flag given on the command line wins. A bad
environment value fails at start with a message naming the variable and the value.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from stagefeed.common.errors import ConfigError

PREFIX = "STAGEFEED_"


def env_name(flag: str) -> str:
    return PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    type: Callable[[str], Any] = str,  # noqa: A002 - mirrors argparse
    default: Any = None,
    help: str = "",  # noqa: A002
    choices: Any = None,
    shown_default: str | None = None,
) -> None:
    """``parser.add_argument(flag, ...)`` whose default comes from the environment if set.

    ``shown_default``: what the help says the default is, for a flag whose default is None so
    that the command can tell whether it was given (``--steps`` against ``--steps-per-epoch``).
    """
    name = env_name(flag)
    raw = os.environ.get(name)
    if raw is not None and raw != "":
        try:
            default = type(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}={raw!r} is not a valid {flag}: {exc}") from None
        if choices is not None and default not in choices:
            raise ConfigError(f"{name}={raw!r} must be one of {', '.join(map(str, choices))}")
    parser.add_argument(
        flag,
        type=type,
        default=default,
        choices=choices,
        help=f"{help} [env {name}; default: {shown_default or '%(default)s'}]",
    )


def add_switch(parser: argparse.ArgumentParser | Any, flag: str, help: str = "") -> None:  # noqa: A002
    """A boolean flag; ``STAGEFEED_X=1|true|yes`` turns it on."""
    name = env_name(flag)
    raw = os.environ.get(name, "").strip().lower()
    if raw not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"{name}={raw!r} must be 1/0, true/false or yes/no")
    parser.add_argument(
        flag, action="store_true", default=raw in ("1", "true", "yes"), help=f"{help} [env {name}]"
    )
