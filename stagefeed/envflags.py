"""Flags that also read ``STAGEFEED_*`` environment variables (same meaning, same checks).

``--queue-mb`` reads ``STAGEFEED_QUEUE_MB``; a flag given on the command line wins. A bad
environment value fails at start with a message naming the variable and the value, but only
for the command that runs (``check``): one environment serves every command, and a value may
be valid for one and not another (``STAGEFEED_TRANSPORT=ipc`` is a deprecated spelling ``run``
still takes and ``train`` never took; a compose file sets variables for a trainer whose
healthcheck runs ``health``, which has no such flag).

A renamed flag keeps its old name as a deprecated alias (``add(..., old="--recv-threads")``):
the old flag and the old variable are still taken, and each use is one warning in the log
(``say_deprecated``, once logging is set up), saying what to write instead.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from stagefeed.common.errors import ConfigError

PREFIX = "STAGEFEED_"
# The namespace attribute holding a subcommand's first bad environment value (see ``check``).
_ENV_ERROR = "envflags_error"
# The namespace attribute holding what deprecated names were used (see ``say_deprecated``).
_DEPRECATED = "envflags_deprecated"

log = logging.getLogger(__name__)


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
    metavar: str | None = None,
    old: str | None = None,
) -> None:
    """``parser.add_argument(flag, ...)`` whose default comes from the environment if set.

    ``shown_default``: what the help says the default is, for a flag whose default is None so
    that the command can tell whether it was given (``--steps`` against ``--steps-per-epoch``).
    ``old``: the flag's deprecated former name, taken with its variable (hidden from the help).
    """
    name = env_name(flag)
    raw = os.environ.get(name)
    if old is not None and not raw and os.environ.get(env_name(old)):
        raw, name = os.environ[env_name(old)], env_name(old)
        _said(parser, f"{name} is deprecated: say {env_name(flag)}")
    if raw is not None and raw != "":
        try:
            value = type(raw)
        except (TypeError, ValueError) as exc:
            _defer(parser, f"{name}={_shown(raw)} is not a valid {flag}: {str(exc)[:200]}")
        else:
            if choices is not None and value not in choices:
                listed = ", ".join(map(str, choices))
                _defer(parser, f"{name}={_shown(raw)} must be one of {listed}")
            else:
                default = value
    parser.add_argument(
        flag,
        type=type,
        default=default,
        choices=choices,
        metavar=metavar,
        help=f"{help} [env {env_name(flag)}; default: {shown_default or '%(default)s'}]",
    )
    if old is not None:
        parser.add_argument(
            old, type=type, choices=choices, dest=flag.lstrip("-").replace("-", "_"),
            default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=_Deprecated,
        )  # fmt: skip


class _Deprecated(argparse.Action):
    """A deprecated flag: stores its value where the new one does and notes the use."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        new = "--" + self.dest.replace("_", "-")
        said = getattr(namespace, _DEPRECATED, ())
        setattr(namespace, _DEPRECATED, (*said, f"{option_string} is deprecated: say {new}"))


def add_switch(parser: argparse.ArgumentParser | Any, flag: str, help: str = "") -> None:  # noqa: A002
    """A boolean flag; ``STAGEFEED_X=1|true|yes`` turns it on."""
    name = env_name(flag)
    raw = os.environ.get(name, "").strip().lower()
    if raw not in ("", "0", "1", "true", "false", "yes", "no"):
        _defer(parser, f"{name}={_shown(raw)} must be 1/0, true/false or yes/no")
    parser.add_argument(
        flag, action="store_true", default=raw in ("1", "true", "yes"), help=f"{help} [env {name}]"
    )


def say_deprecated(args: argparse.Namespace) -> None:
    """One warning for each deprecated flag or variable the parsed command was given."""
    for line in getattr(args, _DEPRECATED, ()):
        log.warning("%s", line)


def check(args: argparse.Namespace) -> None:
    """Raise ``ConfigError`` for the parsed command's first bad environment value, if any."""
    error = getattr(args, _ENV_ERROR, None)
    if error:
        raise ConfigError(error)


def _defer(parser: argparse.ArgumentParser | Any, error: str) -> None:
    """Keep ``error`` in the defaults of ``parser`` (a subcommand's, or a group of it): it
    reaches the namespace only when that subcommand is the one parsed."""
    if parser.get_default(_ENV_ERROR) is None:
        parser.set_defaults(**{_ENV_ERROR: error})


def _said(parser: argparse.ArgumentParser | Any, line: str) -> None:
    """Note ``line`` in the defaults of ``parser``, like ``_defer``: said only if that
    subcommand is the one parsed."""
    said = parser.get_default(_DEPRECATED) or ()
    parser.set_defaults(**{_DEPRECATED: (*said, line)})


def _shown(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to about ``limit`` characters (a value may be thousands long)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
