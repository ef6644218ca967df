"""What glibc's malloc holds for the trainer: bytes in use and freed bytes it keeps for reuse.

The malloc policy (``consumer.memory.malloc_policy``) keeps freed batch buffers in the heap, so the
trainer's RSS sits at its high-water mark and does not tell bytes held (which the byte budgets
bound) from bytes freed and kept (which the allocator's history sets: arenas, fragmentation,
bursts of small messages). These two figures tell them apart, in the metrics and in tests.

Invariant: ``in_use + free`` is every byte malloc has taken from the OS (heaps and mapped
blocks). With trimming off, a freed block that was written stays resident; pages never written
are not resident, free or not. So ``free`` is an upper bound on the resident memory malloc keeps
spare, not its measure: one ``make run`` ended with 4571.9 MiB free against a peak RSS of
4209.0 MiB (which blocks were not written in full was not traced). Allocations that bypass
malloc (Python's small-object arenas, ZeroMQ's and TensorFlow's own mappings, shared-memory
pools) are in neither figure.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33, malloc.h: struct mallinfo2, every field a size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HeapBytes:
    in_use: int  # allocated and not freed: heap chunks plus blocks mapped apart (hblkhd)
    free: int  # freed and kept in the heaps for reuse (fordblks)
    mapped_apart: int  # of in_use, blocks mmap'd apart from the heaps (hblkhd)


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError) as exc:
        log.debug("heap figures unavailable (no glibc mallinfo2: %s)", exc)
        return None
    function.argtypes = []
    function.restype = _MallInfo2
    return function


def read() -> HeapBytes | None:
    """The process's malloc figures now; None where malloc is not glibc >= 2.33.

    Cost: glibc locks each arena in turn and walks its bins (3-5 us in a process that has
    imported TensorFlow, this machine), so it is read per metrics scrape, not per batch.
    """
    function = _mallinfo2()
    if function is None:
        return None
    info = function()
    return HeapBytes(
        in_use=info.uordblks + info.hblkhd, free=info.fordblks, mapped_apart=info.hblkhd
    )
