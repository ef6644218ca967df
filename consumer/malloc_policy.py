"""Keep freed batch-sized buffers in the trainer's heap instead of returning them to the OS.

glibc serves every allocation over its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and
unmaps it on ``free``. A 158 MB batch then costs ~39,000 page faults each time ZeroMQ receives
one and each time TensorFlow copies one: measured at 18-21 core-ms per batch in ZeroMQ's I/O
thread alone (docs/benchmarks.md), on the cores the train step needs. With mmap disabled and
trimming pushed out of reach, freed buffers are reused from the heap: the trainer's RSS stays at
its high-water mark (which the byte budgets bound) rather than falling between batches.

Disabling mmap is not enough on its own. A thread other than the main one allocates from an
arena of its own, whose heaps are at most 64 MiB: a larger block (a 158 MB float32 batch) does
not fit there, and glibc maps it afresh whatever the mmap setting. ZeroMQ's I/O thread and the
enqueue threads are such threads. So the policy also limits glibc to one arena, the main one,
whose heap grows without that limit. That limit only holds for threads that have not allocated
yet: applied once other threads have allocated (TensorFlow imported and run first), those
keep arenas of their own, and the policy says so (it counts glibc's arenas). The command line
applies it before TensorFlow is imported; in a user's script, ``stagefeed.keep_freed_memory()``
before ``import tensorflow`` (or ``MALLOC_ARENA_MAX=1`` in the environment) does the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int

# glibc's HEAP_MAX_SIZE on 64-bit: a block larger than this never fits a thread arena's heap.
THREAD_HEAP_BYTES = 64 * 2**20

_lock = threading.Lock()
_applied: bool | None = None  # the first call's outcome: the policy is process-wide
_arenas_before = 0  # glibc's arenas when it was applied: more than one means late
_warned = False


def keep_freed_memory(largest_block: int | None = None) -> bool:
    """Apply the policy process-wide, once; return False (and say why) where it cannot be
    applied. Later calls return the first call's outcome.

    ``largest_block``: the largest buffer the caller's batches need (its largest array, in
    bytes). If the policy was applied after other threads had arenas of their own and blocks
    that large do not fit a thread arena, a warning (once per process) says how to apply it in
    time; None counts as large.
    """
    global _applied, _warned
    with _lock:
        if _applied is None:
            _applied = _apply()
        large = largest_block is None or largest_block > THREAD_HEAP_BYTES
        if _applied and _arenas_before > 1 and large and not _warned:
            _warned = True
            log.warning(
                "malloc policy applied when %d malloc arenas existed (threads had allocated "
                "already): batches those threads allocate may still page-fault; call "
                "stagefeed.keep_freed_memory() before importing TensorFlow, or set "
                "MALLOC_ARENA_MAX=1",
                _arenas_before,
            )
        return _applied


def _apply() -> bool:
    global _arenas_before
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
    _arenas_before = _arenas(libc)
    ok = (
        mallopt(M_ARENA_MAX, 1) == 1
        and mallopt(M_MMAP_MAX, 0) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    if not ok:
        log.warning("malloc policy not applied: mallopt refused; batches will page-fault")
        return False
    # Debug: the command line applies it before its one-line start-up errors can be printed.
    log.debug("malloc: freed batch buffers are kept for reuse (one arena, mmap off, trim off)")
    return True


def _arenas(libc: ctypes.CDLL) -> int:
    """glibc's arenas so far: the ``<heap>`` entries of ``malloc_info``; 0 where it cannot
    tell (then no warning is given)."""
    try:
        open_memstream, malloc_info = libc.open_memstream, libc.malloc_info
        fclose, free = libc.fclose, libc.free
    except AttributeError:
        return 0
    open_memstream.restype = ctypes.c_void_p
    open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    fclose.argtypes = [ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p]
    buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    if not stream:
        return 0
    try:
        malloc_info(0, stream)
    finally:
        fclose(stream)  # sets buffer and size
    try:
        return ctypes.string_at(buffer.value, size.value).count(b"<heap nr=")
    finally:
        free(buffer)
