"""Keep freed batch-sized buffers in the trainer's heap instead of returning them to the OS.

glibc serves every allocation over its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps it on ``free``. A 158 MB batch then costs ~39,000 page faults each time ZeroMQ receives
one and each time TensorFlow copies one: measured at 18-21 core-ms per batch in ZeroMQ's I/O
thread alone (docs/benchmarks.md), on the cores the train step needs. With mmap disabled and
trimming pushed out of reach, freed buffers are reused from the heap: the trainer's RSS stays at
its high-water mark (which the byte budgets bound) rather than falling between batches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Apply the policy process-wide; return False (and say why) where it cannot be applied."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError) as exc:
        log.warning(
            "malloc policy not applied (no glibc mallopt: %s); batches will page-fault", exc
        )
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if ok:
        log.info("malloc: freed batch buffers are kept for reuse (mmap off, trim off)")
    else:
        log.warning("malloc policy not applied: mallopt refused; batches will page-fault")
    return ok
