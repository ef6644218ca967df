"""Preallocated, 64-byte-aligned batch buffers, and the pool a filling source writes into.

Alignment: TensorFlow aliases (does not copy) a fed numpy view whose data is 64-byte aligned,
and the shared-memory transport will hand slots of this layout to the trainer; on the ZeroMQ
path it costs nothing. Every array of a batch starts on its own 64-byte boundary.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from stagefeed.common.options import MIB
from stagefeed.common.schema import Schema

log = logging.getLogger(__name__)

ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = ALIGN) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts at a multiple of ``align``."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def allocate_batch(schema: Schema) -> dict[str, np.ndarray]:
    """One batch of ``schema``: a dict of aligned, uninitialised arrays in wire order."""
    return {name: aligned_empty(shape, dtype) for name, dtype, shape in schema.wire()}


class BufferPool:
    """``size`` batches of ``schema``, each either free or lent out.

    Used from one thread (the producer's main loop). Invariant: a slot is lent by ``take()``
    and comes back only through ``give_back(slot)``, which the producer calls when ZeroMQ has
    released every frame of the batch sent from it (``TrainerChannel``'s release callback).
    So a slot ``take()`` returns is never one ZeroMQ is still reading. With
    ``size == max_unsent + 1`` and at most ``max_unsent`` batches held by the channel, a free
    slot always exists when the producer asks for one; ``take()`` raising means that
    accounting is broken, never that the caller should wait.
    """

    def __init__(self, schema: Schema, size: int) -> None:
        if size < 1:
            raise ValueError(f"a buffer pool needs at least one slot, got {size}")
        self.schema = schema
        self.slots = [allocate_batch(schema) for _ in range(size)]
        self._free = list(range(size - 1, -1, -1))  # a stack: take() pops slot 0 first
        log.debug(
            "buffer pool: %d batches of %.1f MiB", size, schema.batch_bytes / MIB
        )

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot's index; ``RuntimeError`` if none (the held-batch bound was broken)."""
        if not self._free:
            raise RuntimeError("buffer pool exhausted: more batches held than max_unsent")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < len(self.slots):
            raise RuntimeError(f"buffer slot {slot} given back twice or unknown")
        self._free.append(slot)
