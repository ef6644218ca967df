"""Records from a Hugging Face ``datasets.Dataset`` handed over from Python
(``stagefeed[hf]``).

``HFRecords(dataset)``: record ``i`` is row ``i`` with the dataset in numpy format
(``with_format("numpy")``: Arrow-backed, memory-mapped from its cache files). Columns that
are not numbers or arrays of numbers (text, before a transform tokenizes it) are left out of
the derived fields, and said so in the log; give a transform to turn them into arrays. A row
whose array has another shape than the first row's is a ``BadRecord``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import Schema
from stagefeed.producer.data.records import BadRecord, Field, field_of

log = logging.getLogger(__name__)


class HFRecords:
    """A ``datasets.Dataset`` (anything with ``len``, ``ds[i] -> dict`` and
    ``with_format``) as records."""

    def __init__(self, dataset: Any, origin: str = "datasets.Dataset") -> None:
        if not hasattr(dataset, "with_format") or not hasattr(dataset, "__getitem__"):
            raise ConfigError(f"{origin}: a {type(dataset).__name__}, not a datasets.Dataset")
        self.origin = origin
        self.dataset = dataset.with_format("numpy")
        if not len(self.dataset):
            raise ConfigError(f"{origin}: no rows")
        first = self.dataset[0]
        self.all_columns = list(first)
        self._fields: dict[str, Field] = {}
        skipped = []
        for name, value in first.items():
            try:
                self._fields[name] = field_of(np.asarray(value), f"{origin}: column {name!r}")
            except ConfigError:
                skipped.append(name)
        if skipped:
            log.info("%s: columns not carried (not numbers or arrays of numbers): %s",
                     origin, ", ".join(skipped))  # fmt: skip
        self.columns = list(self.all_columns)  # a transform sees every column

    def __len__(self) -> int:
        return len(self.dataset)

    def fields(self) -> dict[str, Field]:
        return dict(self._fields)

    def fit(self, schema: Schema) -> None:
        """Read only the schema's columns (no transform: it may need the others)."""
        self.columns = list(schema.names)

    def record(self, index: int) -> dict[str, np.ndarray]:
        row = self.dataset[int(index)]
        out = {}
        for name in self.columns:
            value = np.asarray(row[name])
            field = self._fields.get(name)
            if field is not None and value.shape != field.shape:
                raise BadRecord(f"{self.where(index)}: column {name!r} has shape "
                                f"{list(value.shape)}, expected {list(field.shape)}")  # fmt: skip
            out[name] = value
        return out

    def where(self, index: int) -> str:
        return f"{self.origin} row {index}"
