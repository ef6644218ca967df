"""The schema a built-in data source derives from its data (``stagefeed.data_flags``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from stagefeed.common.data_ref import DataRef
from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import Schema
from stagefeed.producer.data.named import open_records
from stagefeed.producer.data.records import BadRecord, Field, Records, field_of, schema_of
from stagefeed.producer.data.transform import record_rng, resolve_transform


def derive_schema(
    ref: DataRef,
    batch_size: int,
    seed: int = 0,
    transform: str | None = None,
    image_size: tuple[int, int] | None = None,
) -> Schema:
    """Batches of ``batch_size`` records of ``ref``'s data (after ``transform``)."""
    records = open_records(ref, image_size)
    return schema_of(record_fields(records, seed, transform), batch_size)


def record_fields(
    records: Records, seed: int = 0, transform: str | None = None
) -> dict[str, Field]:
    """The fields of ``records``, or of what ``transform`` makes of record 0 (a field that
    keeps its name and dtype keeps what the reader knew of it, bounds and cast, at the shape
    the transform made: a crop of ``images`` is still cast and scaled on the device)."""
    fields = records.fields()
    if transform is None:
        return fields
    function = resolve_transform(transform)
    try:
        made = function(records.record(0), record_rng(seed, 0, 0))
    except BadRecord as exc:
        raise ConfigError(f"cannot derive the schema: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - user code: one line naming it
        raise ConfigError(f"--transform {transform} failed on {records.where(0)}: "
                          f"{type(exc).__name__}: {exc}") from None  # fmt: skip
    if not isinstance(made, dict) or not made:
        raise ConfigError(f"--transform {transform} returned a {type(made).__name__}, "
                          "not a dict of arrays")  # fmt: skip
    derived = {}
    for name, value in made.items():
        field = field_of(np.asarray(value), f"--transform {transform}: {name}")
        known = fields.get(name)
        same = known is not None and known.dtype == field.dtype
        derived[name] = dataclasses.replace(known, shape=field.shape) if same else field
    return derived
