"""Bounded descriptions of untrusted data, for error texts and logs.

Received values (a header field, a slot descriptor, a pool announce) may be nested a thousand
deep or hold megabytes: ``repr`` would recurse through all of it (``RecursionError``) or build
it whole before a format spec cuts it (``f"{value!r:.80}"`` truncates only afterwards). An
excerpt looks at the top level only: a string or bytes prefix, a scalar, or a container's type
and length. Its cost does not depend on the value's size or depth.
"""

from __future__ import annotations

from typing import Any

# Python refuses str() of ints over 4300 digits; msgpack carries none over 64 bits, but a
# schema file may.
_MAX_INT_BITS = 128


def excerpt(value: Any, limit: int = 60) -> str:
    """A bounded, escaped description of ``value``: never ``repr`` of a whole structure."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit])
    elif isinstance(value, int) and not isinstance(value, bool):
        bits = value.bit_length()
        text = repr(value) if bits <= _MAX_INT_BITS else f"an int of {bits} bits"
    elif isinstance(value, (bool, float)) or value is None:
        text = repr(value)
    else:
        size = len(value) if isinstance(value, (list, dict, tuple)) else None
        text = type(value).__name__ + ("" if size is None else f" of {size}")
    return text[: limit + 20]
