"""Records from Parquet files, read one row group at a time (pyarrow, ``stagefeed[parquet]``).

``ParquetRecords(paths)``: the rows of the files (a folder stands for its ``*.parquet``
files, sorted), in order. Only the file footers are read at start: the row counts of every
row group say where record ``i`` is. A record's row group is read when first needed (only
the columns the schema uses) and kept in a small cache (``cache`` row groups): read in
order, each row group is read once; shuffled, a batch reads the row groups its records fall
in, so small row groups (or ``npy``) suit random access better.

Columns: numbers and booleans are scalars per record; a list of numbers is an array of the
length a ``fixed_size_list`` declares, or else of the first row's length (a row of another
length, a null, or a list holding a null is a ``BadRecord`` naming the file, the row and the
column). Other columns (strings, binaries, structs) cannot be carried: the derived schema
leaves them out, saying so in the log; a schema that names one, or a column that is not in
the file, is refused at start in one line.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import Schema
from stagefeed.producer.data.records import BadRecord, Field, dtype_name

log = logging.getLogger(__name__)


def _pyarrow(origin: str) -> tuple[Any, Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{origin}: reading Parquet needs pyarrow: "
                          "pip install 'stagefeed[parquet]'") from None  # fmt: skip
    return pa, pc, pq


def parquet_files(paths: Sequence[str], origin: str) -> list[str]:
    """``paths`` with each folder replaced by its ``*.parquet`` files, sorted."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(e.path for e in os.scandir(path) if e.name.endswith(".parquet"))
            if not found:
                raise ConfigError(f"{origin}: folder {path} holds no .parquet files")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ConfigError(f"{origin}: {path}: no such file or folder")
    return files


class ParquetRecords:
    """The rows of Parquet files as records; see the module docstring."""

    def __init__(self, paths: Sequence[str], cache: int = 8) -> None:
        self.origin = "parquet:" + ",".join(paths)
        self._pa, self._pc, pq = _pyarrow(self.origin)
        self.files = parquet_files(paths, self.origin)
        self._pieces: list[tuple[str, Any, int]] = []  # (path, ParquetFile, row group)
        self._starts: list[int] = []
        length = 0
        schema: Any = None  # the first file's pyarrow.Schema (untyped); set when a row is
        for path in self.files:
            try:
                handle = pq.ParquetFile(path)
            except (OSError, self._pa.ArrowException) as exc:
                raise ConfigError(f"{self.origin}: {path} is not a Parquet file: {exc}") from None
            if schema is None:
                schema = handle.schema_arrow
            elif not handle.schema_arrow.equals(schema):
                raise ConfigError(
                    f"{self.origin}: {path} has other columns or types than {self.files[0]}"
                )
            for group in range(handle.metadata.num_row_groups):
                self._starts.append(length)
                self._pieces.append((path, handle, group))
                length += handle.metadata.row_group(group).num_rows
        if not length:
            raise ConfigError(f"{self.origin}: no rows")
        self._length = length
        self._arrow_schema = schema
        self._fields, skipped = self._derive_fields()
        if skipped:
            log.info("%s: columns not carried (not numbers or lists of numbers): %s",
                     self.origin, ", ".join(skipped))  # fmt: skip
        self.columns = list(self._fields)
        self._cache: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
        self._cache_size = max(1, cache)

    def __len__(self) -> int:
        return self._length

    def fields(self) -> dict[str, Field]:
        return dict(self._fields)

    def fit(self, schema: Schema) -> None:
        """Read only the schema's columns; ``ConfigError`` for one not carried."""
        names = schema.names
        for name in names:
            if name not in self._fields:
                what = "is not a column" if self._arrow_schema.get_field_index(name) < 0 else (
                    f"is {self._arrow_schema.field(name).type}, not numbers or a list of them")
                raise ConfigError(f"{self.origin}: {name!r} {what} of {self.files[0]}")
        self.columns = list(names)
        self._cache.clear()

    def where(self, index: int) -> str:
        piece = bisect.bisect_right(self._starts, index) - 1
        path, _, group = self._pieces[piece]
        return f"{path} row group {group} row {index - self._starts[piece]} (record {index})"

    def record(self, index: int) -> dict[str, np.ndarray]:
        piece = bisect.bisect_right(self._starts, index) - 1
        columns = self._group(piece)
        row = index - self._starts[piece]
        out = {}
        for name in self.columns:
            values, bad = columns[name]
            if bad is not None and bad[row]:
                raise BadRecord(f"{self.where(index)}: column {name!r}: {bad[row]}")
            out[name] = values(row) if callable(values) else np.asarray(values[row])
        return out

    def _group(self, piece: int) -> dict[str, Any]:
        cached = self._cache.get(piece)
        if cached is not None:
            self._cache.move_to_end(piece)
            return cached
        _, handle, group = self._pieces[piece]
        table = handle.read_row_group(group, columns=self.columns)
        columns = {name: self._convert(name, table.column(name)) for name in self.columns}
        self._cache[piece] = columns
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return columns

    def _derive_fields(self) -> tuple[dict[str, Field], list[str]]:
        fields: dict[str, Field] = {}
        skipped = []
        pa = self._pa
        for field in self._arrow_schema:
            kind = field.type
            try:
                if pa.types.is_list(kind) or pa.types.is_large_list(kind):
                    length = self._first_length(field.name)
                    fields[field.name] = Field(self._dtype(kind.value_type, field.name), (length,))
                elif pa.types.is_fixed_size_list(kind):
                    fields[field.name] = Field(
                        self._dtype(kind.value_type, field.name), (kind.list_size,)
                    )
                elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or (
                    pa.types.is_boolean(kind)
                ):
                    fields[field.name] = Field(self._dtype(kind, field.name), ())
                else:
                    skipped.append(f"{field.name} ({kind})")
            except ConfigError as exc:
                skipped.append(f"{field.name} ({exc})")
        if not fields:
            raise ConfigError(f"{self.origin}: no column of numbers or lists of numbers")
        return fields, skipped

    def _dtype(self, kind: Any, name: str) -> str:
        if not (self._pa.types.is_integer(kind) or self._pa.types.is_floating(kind)
                or self._pa.types.is_boolean(kind)):  # fmt: skip
            raise ConfigError(f"{kind}")
        return dtype_name(np.dtype(kind.to_pandas_dtype()), f"{self.origin}: column {name!r}")

    def _first_length(self, name: str) -> int:
        _, handle, group = self._pieces[0]
        column = handle.read_row_group(group, columns=[name]).column(name)
        lengths = self._pc.list_value_length(column).drop_null()
        if not len(lengths) or lengths[0].as_py() == 0:
            raise ConfigError("no non-empty first row")
        return int(lengths[0].as_py())

    def _convert(self, name: str, column: Any) -> tuple[Any, np.ndarray | None]:
        """Column ``name`` of one row group: ``(values, bad)``: ``values[row]`` (or
        ``values(row)``) is the row's array, ``bad[row]`` why it is bad ('' if it is not)."""
        pa, pc = self._pa, self._pc
        spec = self._fields[name]
        array = column.combine_chunks()
        rows = len(array)
        why = np.zeros(rows, dtype=object)
        why[:] = ""
        nulls = array.is_null().to_numpy(zero_copy_only=False)
        why[nulls] = "null"
        if not spec.shape:
            filled = pc.fill_null(array, pa.scalar(0, array.type) if not pa.types.is_boolean(
                array.type) else False) if array.null_count else array  # fmt: skip
            values = filled.to_numpy(zero_copy_only=False).astype(spec.dtype, copy=False)
            return values, (why if nulls.any() else None)
        lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(array)
        flat_nulls = flat.is_null().to_numpy(zero_copy_only=False)
        flat_values = pc.fill_null(flat, pa.scalar(0, flat.type)) if flat.null_count else flat
        values = flat_values.to_numpy(zero_copy_only=False).astype(spec.dtype, copy=False)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        expected = spec.shape[0]
        for row in np.flatnonzero((lengths != expected) & ~nulls):
            why[row] = f"{lengths[row]} values, expected {expected}"
        if flat_nulls.any():
            for row in np.flatnonzero(lengths > 0):
                if not why[row] and flat_nulls[starts[row] : starts[row] + lengths[row]].any():
                    why[row] = "a null inside the list"
        bad = why if (why != "").any() else None

        def value(row: int) -> np.ndarray:
            return values[starts[row] : starts[row] + expected]

        return value, bad
