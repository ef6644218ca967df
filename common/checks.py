"""The checks every option shares: an endpoint, a count, a finite number.

Each raises ``ConfigError`` naming the field and the value; the options of each side
(common/options.py) and the flags of the commands call them, so every refusal reads alike.
"""

from __future__ import annotations

import math

from stagefeed.common import endpoints
from stagefeed.common.errors import ConfigError


def check_endpoint(field: str, value: str) -> None:
    """``ConfigError`` naming ``field`` and ``value`` unless ``value`` is a usable endpoint.

    A field named like a bind address (``bind``, ``STAGEFEED_BIND``) may use wildcards (host
    ``*``, port ``*`` or 0, ``ipc://*``); any other field names an address to connect to.
    """
    endpoints.parse(field, value, bind=field.lower().endswith("bind"))


def check_endpoints(field: str, value: object) -> tuple[str, ...]:
    """``value`` (one endpoint, or a sequence of them) as a tuple of endpoints to connect to;
    ``ConfigError`` naming ``field`` and the first bad one, an empty list or a repeated one."""
    if isinstance(value, str):
        if "," in value:
            raise ConfigError(
                f"{field} {value!r}: one endpoint per string; give several as a tuple "
                "(the command line splits STAGEFEED_CONNECT and --connect at commas)"
            )
        value = (value,)
    if not isinstance(value, (tuple, list)) or not value:
        raise ConfigError(f"{field} must name at least one endpoint, got {value!r:.80}")
    for endpoint in value:
        check_endpoint(field, endpoint)
    repeated = sorted({e for e in value if value.count(e) > 1})
    if repeated:
        raise ConfigError(f"{field} names {repeated[0]!r} twice: one channel per trainer")
    return tuple(value)


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``: ``True`` is an int to Python, never a count here."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(field: str, value: object, most: int | None = None) -> None:
    """``ConfigError`` naming ``field`` and ``value`` unless ``value`` is an int, not a bool,
    at least 1 (and at most ``most``, when given)."""
    _check_int(field, value, 1, most)


def check_non_negative_int(field: str, value: object, most: int | None = None) -> None:
    """``ConfigError`` naming ``field`` and ``value`` unless ``value`` is an int, not a bool,
    at least 0 (and at most ``most``, when given)."""
    _check_int(field, value, 0, most)


def _check_int(field: str, value: object, least: int, most: int | None) -> None:
    if is_int(value) and least <= value and (most is None or value <= most):  # type: ignore[operator]
        return
    bound = f">= {least}" if most is None else f"in [{least}, {most}]"
    raise ConfigError(f"{field} must be an integer {bound}, got {value!r:.40}")


def check_number(field: str, value: float, *, zero_ok: bool = False) -> None:
    """``ConfigError`` naming ``field`` and ``value`` unless ``value`` is a finite number
    above 0, or at 0 with ``zero_ok``. NaN and the infinities are refused: a NaN passes every
    comparison check (``nan < 0`` is false). Counts: ``check_positive_int``,
    ``check_non_negative_int``."""
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not (isinstance(value, float) and not math.isfinite(value))
    )
    if not ok or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(
            f"{field} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}"
        )
