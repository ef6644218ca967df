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
enqueue threads are such threads. So for batches with an array over 64 MiB the policy also
limits glibc to one arena, the main one, whose heap grows without that limit (for smaller
batches it does not: one heap keeps what every thread freed, a cost they need not pay). That
limit only holds for threads that have not allocated yet: applied once other threads have
allocated (TensorFlow imported and run first), those keep arenas of their own, and the policy
says so (it counts glibc's arenas). The command line applies it before TensorFlow is imported;
in a user's script, ``stagefeed.keep_freed_memory()`` before ``import tensorflow`` (or
``MALLOC_ARENA_MAX=1`` in the environment) does the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

from stagefeed.common.options import MIB

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int

# glibc's HEAP_MAX_SIZE on 64-bit: a block larger than this never fits a thread arena's heap.
THREAD_HEAP_BYTES = 64 * MIB

_lock = threading.Lock()
_libc: ctypes.CDLL | None = None
_applied: bool | None = None  # mmap and trim off: the first call's outcome, process-wide
_one_arena = False  # the arena limit is on
_warned = False


def keep_freed_memory(largest_block: int | None = None) -> bool:
    """Apply the policy process-wide; return False (and say why) where it cannot be applied.

    ``largest_block``: the largest buffer the caller's batches need (its largest array, in
    bytes; None: unknown, taken as large). mmap and trimming go off at the first call. The
    one-arena limit is added only once a caller's blocks do not fit a thread arena: it is what
    such blocks need, and it has a cost others need not pay (one heap keeps what every thread
    freed, so bursts of small messages leave more behind). If other threads already had
    arenas of their own by then, a warning (once per process) says how to apply it in time.
    """
    global _applied, _one_arena, _warned
    with _lock:
        if _applied is None:
            _applied = _apply()
        large = largest_block is None or largest_block > THREAD_HEAP_BYTES
        if not (_applied and large) or _one_arena:
            return bool(_applied)
        assert _libc is not None
        arenas = _arenas(_libc)  # before the limit: more than one means it comes late
        _one_arena = _libc.mallopt(M_ARENA_MAX, 1) == 1
        if _one_arena:
            log.debug("malloc: one arena, so batch blocks over 64 MiB come from the heap too")
        else:
            log.warning("malloc arena limit refused: batches over 64 MiB will page-fault")
        if _one_arena and arenas > 1 and not _warned:
            _warned = True
            log.warning(
                "malloc policy applied when %d malloc arenas existed (threads had allocated "
                "already): batches those threads allocate may still page-fault; call "
                "stagefeed.keep_freed_memory() before importing TensorFlow, or set "
                "MALLOC_ARENA_MAX=1",
                arenas,
            )
        return True


def _apply() -> bool:
    global _libc
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
    if not ok:
        log.warning("malloc policy not applied: mallopt refused; batches will page-fault")
        return False
    _libc = libc
    # Debug: the command line applies it before its one-line start-up errors can be printed.
    log.debug("malloc: freed batch buffers are kept for reuse (mmap off, trim off)")
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
        if not buffer.value:  # fclose sets it: where it did not, there is nothing to read
            return 0
        return ctypes.string_at(buffer.value, size.value).count(b"<heap nr=")
    finally:
        free(buffer)
