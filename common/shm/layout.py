"""Slot layout and pool announce: the shared-memory format both sides compute identically.

A slot is a 64-byte header of little-endian uint64 words ``gen, seq, state`` followed by the
layout's arrays, each at an offset that is a multiple of 64 from the slot start; the slot
stride is a multiple of 64 too. An mmap starts on a page boundary, so every array of every
slot is 64-byte aligned in every process that maps the pool (TensorFlow aliases such memory).

The announce travels with the pool's fd: ``{"v": 1, "pool": id, "slots": n, "layout":
[[name, dtype, [dims]], ...]}``. The receiver recomputes offsets and stride from the layout;
nothing positional is trusted from the wire. dtypes come from an allow-list checked before
numpy parses them.
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from stagefeed.common.errors import ConfigError, DropReason, ProtocolError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.options import MIB

F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 1)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 4)

ALIGN = 64
HEADER_BYTES = 64
GEN, SEQ, STATE = 0, 1, 2  # uint64 word indices in a slot header


class SlotState(enum.IntEnum):
    """A slot's ``state`` word (``common.shm.slots``: FREE -> WRITING -> COMMITTED -> FREE).
    An ``IntEnum``: the value is what the header's uint64 word holds."""

    FREE = 0
    WRITING = 1
    COMMITTED = 2


FREE, WRITING, COMMITTED = SlotState.FREE, SlotState.WRITING, SlotState.COMMITTED
ANNOUNCE_VERSION = 1
ANNOUNCE_KEYS = frozenset(["v", "pool", "slots", "layout"])
MAX_SLOTS = 4096
MAX_ARRAYS = 16
MAX_NDIM = 9  # the schema's 8 dimensions per example, plus the batch
MAX_DIM = 2**31 - 1
MAX_POOL_BYTES = 2**40
MAX_U64 = 2**64 - 1
# The wire's allow-list (stagefeed.common.spec), repeated so this module stands alone.
ALLOWED_DTYPES = frozenset(
    ["|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"]
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")  # the schema's array names
POOL_ID = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One array of a slot: ``dtype`` is a wire dtype string such as ``"<f4"``."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigError(f"array name {excerpt(self.name)} must match {_NAME.pattern}")
        if not isinstance(self.dtype, str) or self.dtype not in ALLOWED_DTYPES:
            raise ConfigError(
                f"array {self.name!r}: dtype {excerpt(self.dtype)} not in {sorted(ALLOWED_DTYPES)}"
            )
        shape = self.shape
        if not isinstance(shape, tuple) or len(shape) > MAX_NDIM:
            raise ConfigError(
                f"array {self.name!r}: shape {excerpt(shape)} must be a tuple, <= {MAX_NDIM} dims"
            )
        for dim in shape:
            if type(dim) is not int or not 1 <= dim <= MAX_DIM:
                raise ConfigError(
                    f"array {self.name!r}: dimension {excerpt(dim)} must be 1..{MAX_DIM}"
                )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Arrays of one slot; ``offsets`` (from the slot start) are multiples of 64, ``stride``
    (slot size, header included) too, so every array in every slot is 64-byte aligned."""

    arrays: tuple[ArraySpec, ...]
    offsets: tuple[int, ...] = dataclasses.field(init=False)
    stride: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.arrays, tuple) or not 1 <= len(self.arrays) <= MAX_ARRAYS:
            raise ConfigError(f"a layout has 1..{MAX_ARRAYS} arrays, got {excerpt(self.arrays)}")
        names = [a.name for a in self.arrays]
        if len(set(names)) != len(names):
            raise ConfigError(f"array names must be unique: {names}")
        offsets, end = [], HEADER_BYTES
        for spec in self.arrays:
            offsets.append(end)
            end = _align(end + spec.nbytes)
        if end > MAX_POOL_BYTES:
            raise ConfigError(f"one slot would take {end / MIB:.0f} MiB, over the 1 TiB limit")
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "stride", end)

    @classmethod
    def of(cls, arrays: Iterable[tuple[str, Any, Iterable[int]]]) -> SlotLayout:
        """From ``(name, numpy dtype, full shape)`` triples; ConfigError names a bad one."""
        specs = []
        for name, dtype, shape in arrays:
            try:
                wire = np.dtype(dtype).str
            except TypeError as exc:
                raise ConfigError(f"array {name!r}: {dtype!r} is not a numpy dtype") from exc
            specs.append(ArraySpec(name, wire, tuple(int(d) for d in shape)))
        return cls(tuple(specs))

    def to_wire(self) -> list[list[Any]]:
        return [[a.name, a.dtype, list(a.shape)] for a in self.arrays]


@dataclasses.dataclass(frozen=True)
class PoolAnnounce:
    """What a producer tells the trainer with the fd: ``size == slots * layout.stride``."""

    pool_id: str
    slots: int
    layout: SlotLayout

    def __post_init__(self) -> None:
        if not isinstance(self.pool_id, str) or not POOL_ID.fullmatch(self.pool_id):
            raise ConfigError(f"pool id {excerpt(self.pool_id)} must match {POOL_ID.pattern}")
        if type(self.slots) is not int or not 1 <= self.slots <= MAX_SLOTS:
            raise ConfigError(f"slots {excerpt(self.slots)} must be 1..{MAX_SLOTS}")
        if not isinstance(self.layout, SlotLayout):
            raise ConfigError(f"layout must be a SlotLayout, got {type(self.layout).__name__}")
        if self.size > MAX_POOL_BYTES:
            raise ConfigError(f"pool of {self.size / MIB:.0f} MiB is over the 1 TiB limit")

    @property
    def size(self) -> int:
        return self.slots * self.layout.stride

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": ANNOUNCE_VERSION,
            "pool": self.pool_id,
            "slots": self.slots,
            "layout": self.layout.to_wire(),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> PoolAnnounce:
        """Parse a received announce; every defect is a ``ProtocolError``, nothing else. Its
        text quotes received values as bounded excerpts, so any nesting or size is fine."""
        if not isinstance(obj, dict) or set(obj) != ANNOUNCE_KEYS:
            keys = sorted(excerpt(k, 20) for k in obj)[:6] if isinstance(obj, dict) else None
            raise ProtocolError(
                DropReason.HEADER_FIELDS,
                f"pool announce {excerpt(obj)} with keys {keys}, expected {sorted(ANNOUNCE_KEYS)}",
            )
        if type(obj["v"]) is not int or obj["v"] != ANNOUNCE_VERSION:
            raise ProtocolError(DropReason.VERSION, f"pool announce version {excerpt(obj['v'])}")
        layout = obj["layout"]
        if (
            not isinstance(layout, list)
            or not 1 <= len(layout) <= MAX_ARRAYS
            or not all(isinstance(a, list) and len(a) == 3 and isinstance(a[2], list)
                       for a in layout)
        ):  # fmt: skip
            raise ProtocolError(
                DropReason.HEADER_FIELDS,
                f"layout must be 1..{MAX_ARRAYS} [name, dtype, [dims]]: {excerpt(layout)}",
            )
        try:
            specs = tuple(ArraySpec(name, dtype, tuple(dims)) for name, dtype, dims in layout)
            return cls(obj["pool"], obj["slots"], SlotLayout(specs))
        except ConfigError as exc:
            raise ProtocolError(DropReason.HEADER_FIELDS, str(exc)) from None


def header_words(buf: Any, slots: int, layout: SlotLayout) -> np.ndarray:
    """``(slots, 8)`` uint64 view of every slot header in ``buf`` (an mmap).

    Built with ``np.frombuffer``, whose memoryview base holds a buffer export: ``mmap.close()``
    then raises BufferError while a view lives, instead of unmapping memory under it
    (``np.ndarray(buffer=mmap)`` keeps no export, and a view of a closed mmap segfaults).
    """
    words = np.frombuffer(buf, np.uint64, slots * layout.stride // 8)
    return words.reshape(slots, layout.stride // 8)[:, : HEADER_BYTES // 8]


def slot_arrays(buf: Any, layout: SlotLayout, slot: int) -> dict[str, np.ndarray]:
    """Fresh views of one slot's arrays in ``buf`` (read-only if ``buf`` is); see
    ``header_words`` for why they are built with ``np.frombuffer``."""
    base = slot * layout.stride
    return {
        spec.name: np.frombuffer(buf, spec.dtype, math.prod(spec.shape), base + off).reshape(
            spec.shape
        )
        for spec, off in zip(layout.arrays, layout.offsets, strict=True)
    }
