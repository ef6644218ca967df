"""Same-host shared memory, trainer side: map a producer's pool read-only, hand out slots.

``MappedPool`` takes a received pool fd and its announce, refuses it unless it is a regular
file of exactly ``slots x stride`` bytes sealed against shrink and grow (so the producer cannot
truncate it and SIGBUS us), and maps it ``PROT_READ``. ``view(descriptor)`` validates a slot
descriptor against the slot header and returns read-only numpy views, 64-byte aligned.

Release: the views of one accepted slot share a lease object that carries a
``weakref.finalize``; every array that can reach the slot's memory (the views, anything
sliced from them, the reference TensorFlow keeps to the exact object fed until the tensor
using the buffer is gone) keeps the lease alive. When the last dies,
``on_release(pool_id, slot, gen)`` runs exactly once, in whatever thread
dropped it (often TF's, at the end of a ``session.run``), possibly after ``close()``: it must
be quick, must not block, and must tolerate a pool that is gone. Its exceptions are logged.

Validation never raises anything but ``ProtocolError`` (with a distinct ``DropReason``), and
its texts quote received values as bounded excerpts (``common.excerpt``), never their repr.
Trust: a producer can still rewrite a committed slot while it is read; shared memory is for
trusted producers on the same host (see docs/shm.md).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.shm.layout import (
    COMMITTED,
    F_GET_SEALS,
    F_SEAL_GROW,
    F_SEAL_SHRINK,
    GEN,
    MAX_U64,
    POOL_ID,
    SEQ,
    STATE,
    PoolAnnounce,
    header_words,
)

log = logging.getLogger(__name__)

ReleaseHook = Callable[[str, int, int], None]
DESCRIPTOR_KEYS = frozenset(["pool", "slot", "gen", "seq"])
REQUIRED_SEALS = F_SEAL_SHRINK | F_SEAL_GROW


def parse_descriptor(desc: Any) -> tuple[str, int, int, int]:
    """``(pool, slot, gen, seq)`` of a well-formed descriptor, else ProtocolError."""
    if not isinstance(desc, dict) or set(desc) != DESCRIPTOR_KEYS:
        keys = sorted(excerpt(k, 20) for k in desc)[:5] if isinstance(desc, dict) else None
        raise ProtocolError(
            DropReason.SHM_DESCRIPTOR, f"not a slot descriptor: {excerpt(desc)}, keys {keys}"
        )
    pool, slot, gen, seq = desc["pool"], desc["slot"], desc["gen"], desc["seq"]
    if not isinstance(pool, str) or not POOL_ID.fullmatch(pool):
        raise ProtocolError(DropReason.SHM_DESCRIPTOR, f"pool id {excerpt(pool)}")
    for name, value in (("slot", slot), ("gen", gen), ("seq", seq)):
        if type(value) is not int or not 0 <= value <= MAX_U64:
            raise ProtocolError(DropReason.SHM_DESCRIPTOR, f"{name} {excerpt(value)}")
    return pool, slot, gen, seq


def check_pool_fd(fd: int, size: int) -> None:
    """Refuse an fd that is not a memfd sealed against shrink and grow, of exactly ``size``."""
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        raise ProtocolError(DropReason.SHM_SEALS, f"fd has no seals (not a memfd): {exc}") from exc
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ProtocolError(DropReason.SHM_SEALS, f"fd seals {seals:#x} lack SHRINK|GROW")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        raise ProtocolError(
            DropReason.SHM_POOL_SIZE, f"fd holds {info.st_size} bytes, the layout needs {size}"
        )


class _SlotLease:
    """Keeps one accepted slot generation mapped (``region`` holds a buffer export, so the
    mmap cannot be closed under it); its ``weakref.finalize`` is the release signal."""

    __slots__ = ("region", "__weakref__")

    def __init__(self, region: np.ndarray) -> None:
        self.region = region


class _ArrayRef:
    """The base object of one handed-out array (numpy's ``__array_interface__``).

    numpy collapses base chains through arrays but stops at a non-array base, so every view
    derived from a handed-out array (slices, reshapes, TF's reference) keeps this object, and
    with it the lease, alive: the slot is released only when no array can reach it.
    """

    __slots__ = ("__array_interface__", "lease")

    def __init__(self, lease: _SlotLease, shape: tuple[int, ...], dtype: str, addr: int) -> None:
        self.lease = lease
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype,
            "data": (addr, True),
            "version": 3,
        }


class MappedPool:
    """A producer's pool mapped read-only. Thread-safe; ``close()`` is idempotent.

    Takes ownership of ``fd`` and closes it, whether the pool is accepted or refused (the
    mapping keeps the memory). Invariants: a slot generation is accepted at most once; each
    accepted one is released exactly once, when its last view dies.
    """

    def __init__(self, fd: int, announce: PoolAnnounce, on_release: ReleaseHook) -> None:
        try:
            check_pool_fd(fd, announce.size)
            # Populated up front, so the model's first read of each slot takes no page faults.
            self._mm: mmap.mmap | None = mmap.mmap(
                fd, announce.size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ
            )
        finally:
            os.close(fd)
        self.announce = announce
        self.pool_id, self.slots, self.layout = announce.pool_id, announce.slots, announce.layout
        self._hdr = header_words(self._mm, self.slots, self.layout)
        self._on_release = on_release
        self._accepted = [0] * self.slots  # newest generation accepted per slot
        self._outstanding: dict[int, int] = {}  # slot -> gen, views alive
        # Reentrant: a finalizer may run (cyclic GC) in a thread that holds the lock.
        self._lock = threading.RLock()
        self._closed = False

    def check(self, desc: Any) -> tuple[int, int, int]:
        """``(slot, gen, seq)`` if ``desc`` names a committed, current, never-accepted slot
        generation of this pool; otherwise ProtocolError with the reason. Accepts nothing."""
        pool, slot, gen, seq = parse_descriptor(desc)
        with self._lock:
            self._validate(pool, slot, gen, seq)
        return slot, gen, seq

    def _validate(self, pool: str, slot: int, gen: int, seq: int) -> None:
        if pool != self.pool_id:
            raise ProtocolError(DropReason.SHM_POOL, f"descriptor for pool {pool!r}")
        if slot >= self.slots:
            raise ProtocolError(DropReason.SHM_SLOT, f"slot {slot} of {self.slots}")
        if self._closed:
            raise ProtocolError(DropReason.SHM_POOL, f"pool {pool!r} is closed")
        header = self._hdr[slot]
        if int(header[GEN]) != gen:
            raise ProtocolError(
                DropReason.SHM_GENERATION, f"slot {slot} gen {gen}, header {int(header[GEN])}"
            )
        if gen <= self._accepted[slot]:
            raise ProtocolError(DropReason.SHM_REPLAY, f"slot {slot} gen {gen} accepted before")
        if int(header[STATE]) != COMMITTED:
            raise ProtocolError(DropReason.SHM_UNCOMMITTED, f"slot {slot} gen {gen} uncommitted")
        if int(header[SEQ]) != seq:
            raise ProtocolError(
                DropReason.SHM_SEQUENCE, f"slot {slot} seq {seq}, header {int(header[SEQ])}"
            )

    def view(self, desc: Any) -> dict[str, np.ndarray]:
        """Validate ``desc``; read-only, 64-byte aligned views of its slot, released together.

        Feed these objects (or views of them) to TF; a copy (``np.array``) is not tracked.
        """
        pool, slot, gen, seq = parse_descriptor(desc)
        with self._lock:
            self._validate(pool, slot, gen, seq)
            self._accepted[slot] = gen
            self._outstanding[slot] = gen
            stride = self.layout.stride
            lease = _SlotLease(np.frombuffer(self._mm, np.uint8, stride, slot * stride))
            addr = lease.region.ctypes.data
            views = {
                spec.name: np.asarray(_ArrayRef(lease, spec.shape, spec.dtype, addr + offset))
                for spec, offset in zip(self.layout.arrays, self.layout.offsets, strict=True)
            }
            weakref.finalize(lease, self._released, slot, gen).atexit = False
            return views

    def outstanding(self) -> dict[int, int]:
        """Slots whose views are alive: ``{slot: gen}``."""
        with self._lock:
            return dict(self._outstanding)

    def _released(self, slot: int, gen: int) -> None:
        with self._lock:
            if self._outstanding.get(slot) == gen:
                del self._outstanding[slot]
        try:
            self._on_release(self.pool_id, slot, gen)
        except Exception:
            log.exception(
                "pool %s: release hook failed for slot %d gen %d", self.pool_id, slot, gen
            )

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Idempotent. Later descriptors are refused; views alive keep the mapping until they
        die (their releases still arrive, late)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mm, self._mm = self._mm, None
            self._hdr = np.zeros((self.slots, 8), np.uint64)
        try:
            if mm is not None:
                mm.close()
        except BufferError:
            log.info("pool %s closed with views alive; unmapped when they die", self.pool_id)


class PoolTable:
    """The trainer's mapped pools by id: routes descriptors, refuses unknown pools."""

    def __init__(self, max_pools: int = 64) -> None:
        self._pools: dict[str, MappedPool] = {}
        self._max = max_pools
        self._lock = threading.Lock()

    def add(self, pool: MappedPool) -> None:
        """Register an accepted pool; a duplicate id or one too many is refused (closed)."""
        with self._lock:
            if pool.pool_id in self._pools or len(self._pools) >= self._max:
                pool.close()
                raise ProtocolError(
                    DropReason.SHM_POOL, f"pool {pool.pool_id!r}: duplicate or over {self._max}"
                )
            self._pools[pool.pool_id] = pool

    def view(self, desc: Any) -> dict[str, np.ndarray]:
        pool_id = parse_descriptor(desc)[0]
        with self._lock:
            pool = self._pools.get(pool_id)
        if pool is None:
            raise ProtocolError(DropReason.SHM_POOL, f"unknown pool {pool_id!r}")
        return pool.view(desc)

    def remove(self, pool_id: str) -> None:
        """Close and forget a pool (its producer left); unknown ids are ignored."""
        with self._lock:
            pool = self._pools.pop(pool_id, None)
        if pool is not None:
            pool.close()

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._pools)

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
