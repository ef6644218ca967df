"""The record-source contract: ``len()`` records, record ``i`` a dict of numpy arrays.

``Records`` is what every reader implements (and what a user may implement too):

- ``__len__()``: the number of records;
- ``record(i)``: record ``i`` as ``{name: ndarray}`` (one example, no batch dimension), or
  ``BadRecord`` when that record cannot be read (an undecodable image, a null or a row of
  the wrong length): the sampler's ``--on-bad-record`` decides what follows;
- ``fields()``: ``{name: Field}``, what every record holds (the schema is derived from it);
- ``where(i)``: where record ``i`` lives, for messages (a file and an index);
- optionally ``take(indices)``: many records at once as ``{name: (len(indices), ...)}``
  arrays, for readers that can do it faster than one by one (memory-mapped arrays).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import DTYPES, ArraySpec, Schema


class BadRecord(Exception):
    """One record cannot be read or does not fit the schema; the message names where it is
    (file and index) and why."""


@dataclasses.dataclass(frozen=True)
class Field:
    """What one field of every record is: a dtype name of the wire allow-list, a shape per
    record, and what the reader knows on top (``bounds`` of labels, ``cast``/``scale``)."""

    dtype: str
    shape: tuple[int, ...] = ()
    bounds: tuple[int, int] | None = None
    cast: str | None = None
    scale: float | None = None

    def spec(self, name: str) -> ArraySpec:
        return ArraySpec(name, self.dtype, self.shape, self.bounds, self.cast, self.scale)


@runtime_checkable
class Records(Protocol):
    def __len__(self) -> int: ...

    def record(self, index: int) -> dict[str, np.ndarray]: ...

    def fields(self) -> dict[str, Field]: ...

    def where(self, index: int) -> str: ...


def dtype_name(dtype: np.dtype, what: str) -> str:
    """The wire name of ``dtype`` (``float32``, ...); ``ConfigError`` naming ``what`` for a
    dtype the wire does not carry (strings, objects, big-endian, ...)."""
    dtype = np.dtype(dtype)
    for name, code in DTYPES.items():
        if np.dtype(code) == dtype:
            return name
    raise ConfigError(
        f"{what} is {dtype}: not a dtype the feed carries ({', '.join(DTYPES)})"
    )


def field_of(array: np.ndarray, what: str) -> Field:
    """The ``Field`` of one record's value ``array``."""
    return Field(dtype_name(array.dtype, what), tuple(int(d) for d in array.shape))


def schema_of(fields: Mapping[str, Field], batch_size: int) -> Schema:
    """The schema of batches of ``batch_size`` records with these fields (in their order)."""
    return Schema(tuple(f.spec(name) for name, f in fields.items()), batch_size)


def check_names(schema: Schema, names: Sequence[str], what: str) -> None:
    """``ConfigError`` at start unless the records hold every array the schema names."""
    missing = [n for n in schema.names if n not in names]
    if missing:
        raise ConfigError(
            f"{what} has no {', '.join(repr(n) for n in missing)} (the schema's "
            f"{', '.join(schema.names)}; it holds {', '.join(names) or 'nothing'})"
        )


def fit_record(schema: Schema, record: Any, where: str) -> dict[str, np.ndarray]:
    """``record``'s arrays for ``schema`` (a dict with at least its names; each value of the
    row's shape and of its dtype, or one that casts to it safely); ``BadRecord`` else."""
    if not isinstance(record, Mapping):
        raise BadRecord(f"{where}: a {type(record).__name__}, not a dict of arrays")
    out = {}
    for spec in schema.arrays:
        if spec.name not in record:
            raise BadRecord(f"{where}: no {spec.name!r}")
        value = np.asarray(record[spec.name])
        if value.dtype != spec.np_dtype and not np.can_cast(value.dtype, spec.np_dtype, "safe"):
            raise BadRecord(f"{where}: {spec.name} is {value.dtype}, expected {spec.dtype}")
        if value.shape != spec.shape:
            raise BadRecord(
                f"{where}: {spec.name} has shape {list(value.shape)}, expected {list(spec.shape)}"
            )
        out[spec.name] = value
    return out
