"""The per-record transform: ``--transform module:function``, run in the producer.

``function(record, rng)`` gets one record (``{name: ndarray}``) and a ``numpy.random.
Generator`` of its own, seeded from ``(seed, epoch, record index)``: a crop or a flip is the
same whichever producer makes the record and however many there are, and differs from epoch
to epoch. It returns the record to send (a dict with the schema's arrays, each of its row's
shape and dtype, or one that casts to it safely). What it raises is a bad record
(``--on-bad-record``), named with the record's place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.common.refs import import_ref

Transform = Callable[[dict[str, np.ndarray], np.random.Generator], Any]


def resolve_transform(ref: str) -> Transform:
    """The function ``--transform ref`` names; ``ConfigError`` in one line if it is none."""
    if ":" not in ref:
        raise ConfigError(f"--transform {ref!r}: expected module:function")
    function = import_ref(ref, "--transform")
    if not callable(function):
        raise ConfigError(f"--transform {ref!r} is a {type(function).__name__}, not a function")
    return function


def record_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """Record ``index``'s generator in epoch ``epoch`` of a run seeded ``seed``."""
    return np.random.default_rng([seed, epoch, index])
