"""Records from numpy arrays: in memory, or ``.npy`` files memory-mapped.

``ArrayRecords({"x": x, "y": y})``: record ``i`` is ``{"x": x[i], "y": y[i]}``; every array
has the same first dimension. ``open_npy(paths)`` maps each ``.npy`` file read-only
(``np.load(mmap_mode="r")``), named by its file's stem (``data/x.npy`` is ``x``): the
producers of a 50 GB file share the page cache and each holds only the pages it reads.
``take(indices)`` reads a whole batch with one fancy index (only those rows' pages).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from stagefeed.common.errors import ConfigError
from stagefeed.producer.data.records import Field, field_of


class ArrayRecords:
    """Records that are rows of arrays of one length (``np.memmap``s included)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], origin: str = "arrays") -> None:
        if not arrays:
            raise ConfigError(f"{origin}: no arrays")
        self.origin = origin
        self.arrays = {name: np.asanyarray(a) for name, a in arrays.items()}
        lengths = {name: (a.shape[0] if a.ndim else None) for name, a in self.arrays.items()}
        length = next(iter(lengths.values()))
        if length is None or len(set(lengths.values())) != 1:
            shown = ", ".join(f"{n}: {length}" for n, length in lengths.items())
            raise ConfigError(f"{origin}: arrays of different lengths ({shown}), or scalars")
        self._length: int = length
        self._fields = {
            name: field_of(a[:1].reshape(a.shape[1:]), f"{origin}: {name}")
            for name, a in self.arrays.items()
        }

    def __len__(self) -> int:
        return self._length

    def fields(self) -> dict[str, Field]:
        return dict(self._fields)

    def record(self, index: int) -> dict[str, np.ndarray]:
        return {name: np.asarray(a[index]) for name, a in self.arrays.items()}

    def take(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        rows = np.asarray(indices, dtype=np.int64)
        return {name: np.asarray(a[rows]) for name, a in self.arrays.items()}

    def where(self, index: int) -> str:
        return f"{self.origin} record {index}"


def open_npy(paths: Sequence[str]) -> ArrayRecords:
    """The ``.npy`` files ``paths``, memory-mapped, as records (``ConfigError`` at start for a
    missing file, one that is not a ``.npy``, an object array, or two with the same stem)."""
    arrays: dict[str, np.ndarray] = {}
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        if name in arrays:
            raise ConfigError(f"npy:{path}: a second array named {name!r} (named by file stem)")
        arrays[name] = load_npy(path)
    return ArrayRecords(arrays, "npy:" + ",".join(paths))


def load_npy(path: str) -> np.ndarray:
    """``path`` mapped read-only; ``ConfigError`` in one line naming it if it cannot be."""
    if not os.path.isfile(path):
        raise ConfigError(f"npy:{path}: no such file")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"npy:{path}: not a .npy array that can be mapped: {exc}") from None
    if not isinstance(array, np.ndarray):
        raise ConfigError(f"npy:{path}: not a .npy file (an .npz? use npz:{path})")
    return array
