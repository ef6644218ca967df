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
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

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


class Descriptor(NamedTuple):
    """One committed slot generation, as a ``shm_batch`` names it; made only by ``parse``."""

    pool: str
    slot: int
    gen: int
    seq: int

    @classmethod
    def parse(cls, desc: Any) -> Descriptor:
        """The descriptor of a well-formed ``desc`` mapping, else ProtocolError. The only
        place a received descriptor is checked for shape and types."""
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
        return cls(pool, slot, gen, seq)


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

    def _validate(self, desc: Descriptor) -> None:
        pool, slot, gen, seq = desc
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

    def view(self, desc: Descriptor) -> dict[str, np.ndarray]:
        """Check ``desc`` against the slot header (committed, current, never accepted);
        read-only, 64-byte aligned views of its slot, released together.

        Feed these objects (or views of them) to TF; a copy (``np.array``) is not tracked.
        """
        slot, gen = desc.slot, desc.gen
        with self._lock:
            self._validate(desc)
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
    """The trainer's mapped pools and who owns each: the one table of pool ownership.

    Invariants: a pool id is in the table at most once; an owner (a connection) owns at
    most one pool (adding a newer one retires the older); at most ``max_pools`` pools; a
    descriptor is routed only to a pool its own connection owns. Thread-safe.
    """

    def __init__(self, max_pools: int = 64) -> None:
        self._pools: dict[str, tuple[MappedPool, Hashable]] = {}
        self._pool_of: dict[Hashable, str] = {}
        self._max = max_pools
        self._lock = threading.Lock()

    def admit(self, pool_id: str) -> None:
        """ProtocolError (``shm_pool``) unless a pool of this id could be added now."""
        with self._lock:
            self._admit(pool_id)

    def _admit(self, pool_id: str) -> None:
        if pool_id in self._pools or len(self._pools) >= self._max:
            raise ProtocolError(
                DropReason.SHM_POOL, f"pool {pool_id!r}: duplicate, or {self._max} mapped"
            )

    def add(self, pool: MappedPool, owner: Hashable) -> str | None:
        """Register ``owner``'s accepted pool, retiring (closing) the pool it owned before;
        returns that one's id. A duplicate id or one too many is refused (and closed)."""
        with self._lock:
            try:
                self._admit(pool.pool_id)
            except ProtocolError:
                pool.close()
                raise
            old = self._pool_of.pop(owner, None)
            old_pool = self._pools.pop(old)[0] if old is not None else None
            self._pools[pool.pool_id] = (pool, owner)
            self._pool_of[owner] = pool.pool_id
        if old_pool is not None:
            old_pool.close()
        return old

    def owner(self, pool_id: str) -> Hashable | None:
        with self._lock:
            entry = self._pools.get(pool_id)
        return None if entry is None else entry[1]

    def pool_of(self, owner: Hashable) -> str | None:
        with self._lock:
            return self._pool_of.get(owner)

    def view(self, desc: Descriptor, owner: Hashable) -> dict[str, np.ndarray]:
        """The views of ``desc``, received from ``owner``: ProtocolError if the pool is
        unknown, another owner's, or the slot is not current (``MappedPool.view``)."""
        with self._lock:
            entry = self._pools.get(desc.pool)
        if entry is None:
            raise ProtocolError(DropReason.SHM_POOL, f"unknown pool {desc.pool!r}")
        if entry[1] != owner:
            raise ProtocolError(DropReason.SHM_POOL, f"pool {desc.pool!r} is another connection's")
        return entry[0].view(desc)

    def remove(self, pool_id: str, owner: Hashable | None = None) -> bool:
        """Close and forget a pool (its producer left), if ``owner`` (when given) still owns
        it. Whether it was removed; unknown ids are ignored."""
        with self._lock:
            entry = self._pools.get(pool_id)
            if entry is None or (owner is not None and entry[1] != owner):
                return False
            del self._pools[pool_id]
            del self._pool_of[entry[1]]
        entry[0].close()
        return True

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._pools)

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            pools = [pool for pool, _owner in self._pools.values()]
            self._pools, self._pool_of = {}, {}
        for pool in pools:
            pool.close()
