"""Same-host shared memory, producer side: a sealed memfd cut into fixed batch slots.

A ``SlotPool`` owns one memfd (no name in /dev/shm, so nothing leaks when a process is
killed) of ``slots x layout.stride`` bytes, reserved up front with ``posix_fallocate`` (no
sparse file that SIGBUSes on first write) and sealed against shrinking and growing, so no one
holding the fd can truncate the memory under a reader.

Slots are laid out by ``shm_layout.SlotLayout`` (a 64-byte header, then 64-byte aligned
arrays). A slot's life::

    FREE --acquire()--> WRITING --commit(seq)--> COMMITTED --release(gen)--> FREE
                          \\--discard()--> FREE

``acquire`` writes ``state=WRITING`` and then the incremented ``gen``, before any data;
``commit`` writes ``seq`` and then ``state=COMMITTED``, after the data. A reader accepts a slot
only when the header says COMMITTED with the descriptor's ``gen`` and ``seq``, so a producer
killed mid-write leaves a slot that is never accepted. Python's own bookkeeping (not the
shared header) is the authority for the producer; the trainer maps the pool read-only.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
from typing import Any

import numpy as np

from stagefeed.common.errors import ClosedError, ConfigError
from stagefeed.common.shm.layout import (
    COMMITTED,
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    FREE,
    GEN,
    MAX_U64,
    MIB,
    SEQ,
    STATE,
    WRITING,
    PoolAnnounce,
    SlotLayout,
    header_words,
    slot_arrays,
)

log = logging.getLogger(__name__)


def reserve(fd: int, nbytes: int, what: str = "shared-memory pool") -> None:
    """Allocate ``nbytes`` behind ``fd`` now; ENOSPC/EFBIG/ENOMEM become a ``ConfigError``."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise
        raise ConfigError(
            f"{what} needs {nbytes / MIB:.1f} MiB ({nbytes} bytes) and the system refused it "
            f"({errno.errorcode[exc.errno]}: {exc.strerror}): give the process or container more "
            "memory (or a larger tmpfs / RLIMIT_FSIZE), or use fewer or smaller slots"
        ) from exc


class SlotPool:
    """A producer's slots in one sealed memfd. Thread-safe; ``close()`` is idempotent.

    Invariants: a slot is in exactly one of FREE (in the free list), WRITING (handed out by
    ``acquire``) or COMMITTED (a descriptor went out, awaiting ``release``); each ``acquire``
    bumps the slot's generation, so a release or descriptor of an older round never matches.
    """

    def __init__(self, layout: SlotLayout, slots: int, pool_id: str | None = None) -> None:
        pool_id = pool_id or f"p{os.getpid()}-{secrets.token_hex(6)}"
        self.announcement = PoolAnnounce(pool_id, slots, layout)
        self.pool_id, self.layout, self.slots = pool_id, layout, slots
        self.size = self.announcement.size
        self._fd = os.memfd_create(f"stagefeed-{pool_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            reserve(self._fd, self.size)
            fcntl.fcntl(self._fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
            # MAP_POPULATE: the page tables are filled now, once, not by a minor fault per
            # 4 KiB page on each slot's first write (measured: a 40 MiB slot's first copy
            # took 3x its later ones).
            self._mm: mmap.mmap | None = mmap.mmap(
                self._fd, self.size, mmap.MAP_SHARED | mmap.MAP_POPULATE
            )
        except BaseException:
            os.close(self._fd)
            raise
        self._hdr = header_words(self._mm, slots, layout)
        self._views = [slot_arrays(self._mm, layout, i) for i in range(slots)]
        self._gen = [0] * slots
        self._state = [FREE] * slots
        self._free = collections.deque(range(slots))
        self._cond = threading.Condition()
        self._closed = False

    @property
    def fd(self) -> int:
        """The memfd, to pass to the trainer (``socket.send_fds``); owned by the pool."""
        if self._closed:
            raise ClosedError(f"pool {self.pool_id} is closed")
        return self._fd

    def announce(self) -> dict[str, Any]:
        """The msgpack-able header that travels with the fd."""
        return self.announcement.to_wire()

    def generation(self, slot: int) -> int:
        """The slot's current generation (0 until first acquired)."""
        with self._cond:
            return self._gen[slot]

    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None, stop: threading.Event | None = None) -> int:
        """A FREE slot, now WRITING. Blocks; TimeoutError after ``timeout`` s, ClosedError
        once the pool is closed or ``stop`` is set (polled every 0.1 s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                if self._closed or (stop is not None and stop.is_set()):
                    raise ClosedError(f"pool {self.pool_id}: stopped while waiting for a slot")
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"pool {self.pool_id}: no free slot in {timeout} s")
                self._cond.wait(left)
            if self._closed:
                raise ClosedError(f"pool {self.pool_id} is closed")
            slot = self._free.popleft()
            self._gen[slot] += 1
            self._state[slot] = WRITING
            self._hdr[slot, STATE] = WRITING  # before gen: no reader sees a new gen committed
            self._hdr[slot, GEN] = self._gen[slot]
            return slot

    def arrays(self, slot: int) -> dict[str, np.ndarray]:
        """Writable views of a WRITING slot (the same objects each round)."""
        self._expect(slot, WRITING)
        return self._views[slot]

    def commit(self, slot: int, seq: int) -> dict[str, Any]:
        """Publish a WRITING slot after its data; returns its descriptor for the trainer."""
        if type(seq) is not int or not 0 <= seq <= MAX_U64:
            raise ValueError(f"seq {seq!r} must be an int in [0, 2**64)")
        with self._cond:
            self._expect(slot, WRITING)
            self._hdr[slot, SEQ] = seq
            self._hdr[slot, STATE] = COMMITTED  # last: the data and seq are in place
            self._state[slot] = COMMITTED
            return {"pool": self.pool_id, "slot": slot, "gen": self._gen[slot], "seq": seq}

    def discard(self, slot: int) -> None:
        """Give back a WRITING slot that will not be committed (its source failed)."""
        with self._cond:
            self._expect(slot, WRITING)
            self._to_free(slot)

    def release(self, slot: int, gen: int) -> bool:
        """The trainer is done with ``slot`` of generation ``gen``: it becomes FREE.

        Returns False (and changes nothing) for a late, duplicate or foreign release: wrong
        generation, slot not COMMITTED, or pool closed.
        """
        with self._cond:
            if self._closed or type(slot) is not int or not 0 <= slot < self.slots:
                return False
            if self._state[slot] != COMMITTED or self._gen[slot] != gen:
                log.debug("pool %s: ignored release of slot %s gen %s", self.pool_id, slot, gen)
                return False
            self._to_free(slot)
            return True

    def _to_free(self, slot: int) -> None:
        self._hdr[slot, STATE] = FREE
        self._state[slot] = FREE
        self._free.append(slot)
        self._cond.notify()

    def _expect(self, slot: int, state: int) -> None:
        if self._closed:
            raise ClosedError(f"pool {self.pool_id} is closed")
        if type(slot) is not int or not 0 <= slot < self.slots or self._state[slot] != state:
            raise ValueError(f"pool {self.pool_id}: slot {slot!r} is not in state {state}")

    def close(self) -> None:
        """Idempotent. Unmaps once no view is referenced, closes the fd; the memory lives on
        while the trainer maps it. Blocked ``acquire`` calls raise ClosedError."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        mm, self._mm = self._mm, None
        self._views, self._hdr = [], np.empty((0, 8), np.uint64)
        try:
            if mm is not None:
                mm.close()
        except BufferError:
            log.warning("pool %s: slot views still referenced; unmapped when dropped", self.pool_id)
        os.close(self._fd)

    def __enter__(self) -> SlotPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
