"""A producer's shared-memory lane: its slot pool, offered to the trainer that welcomed it, and
the slots that trainer gives back.

Threads: the channel thread (``producer.link``) calls ``on_welcome`` on every welcome (attach a
new pool, or fall back to ZeroMQ) and ``release`` for each ``release`` message; the producer's
main loop calls ``acquire`` / ``commit`` / ``discard`` (through ``TrainerChannel``). Errors of
``on_welcome`` are raised in the channel thread, which carries them to the main loop.

Invariants:

- one pool per welcome. A trainer that welcomes us again (it was restarted, or it forgot the
  connection) gets a new pool; the old one is retired: its fd channel is closed (the trainer
  unmaps it once TensorFlow is done with its slots) and the pool is closed as soon as no slot
  of it is being written. Nothing of a retired pool is ever written again, so slots an old
  trainer may still read stay intact; they are freed when it lets go.
- a descriptor of a pool exists only after the trainer accepted that pool (``offer_pool``
  returned), so the trainer always knows a pool before any descriptor of it arrives.
- mode: ``pending`` until the first welcome, then ``shm`` (a pool attached) or ``zmq``
  (``auto`` fell back, with the reason logged once per welcome).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Any

from stagefeed.common.errors import BrokenError, ClosedError, ConfigError, ProtocolError
from stagefeed.common.schema import Schema
from stagefeed.common.shm.fd_passing import FdChannel, offer_pool, refusal_text
from stagefeed.common.shm.layout import MIB, SlotLayout
from stagefeed.common.shm.slots import SlotPool

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
OFFER_TIMEOUT_S = 10.0
PENDING, SHM, ZMQ = "pending", "shm", "zmq"


@dataclasses.dataclass(frozen=True)
class ShmOffer:
    """The ``shm_*`` fields of a welcome: where to offer the pool, the token tying the offer to
    this connection, and how many slots the trainer sized it for."""

    socket: str
    token: str
    slots: int


def ignore_sigxfsz() -> None:
    """Reserving a pool over RLIMIT_FSIZE must fail with EFBIG (a ConfigError naming the
    size), not kill the process with SIGXFSZ. Main thread only; elsewhere a no-op."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def available_bytes() -> int | None:
    """Memory a new pool can take now: MemAvailable, and the cgroup v2 limit's headroom."""
    room: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room.append(int(line.split()[1]) * 1024)
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
                room.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(room) if room else None


class ShmLane:
    """See the module docstring. ``transport`` is ``shm`` (a pool or fail) or ``auto``."""

    def __init__(self, transport: str, endpoint: str) -> None:
        if transport not in (SHM, "auto"):
            raise ConfigError(f"a shared-memory lane is for transport shm or auto: {transport!r}")
        self.transport = transport
        self.endpoint = endpoint
        self._cond = threading.Condition()
        self._mode = PENDING
        self._pool: SlotPool | None = None
        self._channel: FdChannel | None = None
        self._writing: SlotPool | None = None  # the pool the main loop holds a slot of
        self._retired: list[SlotPool] = []  # closed once that slot is committed or discarded
        self.pools_offered = 0
        self._closed = False

    @property
    def mode(self) -> str:
        with self._cond:
            return self._mode

    @property
    def pool_id(self) -> str | None:
        """The current pool's id (descriptors of any other pool are stale)."""
        with self._cond:
            return None if self._pool is None else self._pool.pool_id

    # -- the channel thread ------------------------------------------------------------------

    def on_welcome(self, offer: ShmOffer | None, schema: Schema) -> None:
        """A welcome arrived: retire the pool of the previous one, attach a new pool for this
        one or fall back. ``ConfigError`` / ``BrokenError`` when ``transport`` is ``shm`` and
        the trainer offers no shared memory, refuses the pool, or the pool does not fit."""
        self._retire()
        try:
            if offer is None:
                raise ConfigError(
                    f"the trainer at {self.endpoint} offers no shared memory: start it with "
                    "--transport shm (or auto), or run this producer with --transport zmq"
                )
            pool, channel = self._attach(offer, schema)
        except (ConfigError, BrokenError) as exc:
            if self.transport == SHM:
                raise
            log.warning("shared memory unavailable, batches go over ZeroMQ: %s", exc)
            with self._cond:
                self._mode = ZMQ
                self._cond.notify_all()
            return
        with self._cond:
            self._pool, self._channel, self._mode = pool, channel, SHM
            self.pools_offered += 1
            self._cond.notify_all()

    def _attach(self, offer: ShmOffer, schema: Schema) -> tuple[SlotPool, FdChannel]:
        layout = SlotLayout.of(schema.wire())
        nbytes = offer.slots * layout.stride
        room = available_bytes()
        if room is not None and nbytes > room:
            raise ConfigError(self._too_big(offer, nbytes, f"only {room / MIB:.1f} MiB is free"))
        try:
            pool = SlotPool(layout, offer.slots)
        except ConfigError as exc:
            raise ConfigError(self._too_big(offer, nbytes, str(exc))) from None
        channel = None
        try:
            channel = FdChannel.connect(offer.socket, timeout=CONNECT_TIMEOUT_S)
            channel.send({"token": offer.token})
            reply, fd = channel.recv(timeout=OFFER_TIMEOUT_S)
            if fd is not None:
                channel.close()
                raise BrokenError("the trainer sent an fd with its token answer")
            if reply.get("ok") is not True:
                raise BrokenError(f"the trainer refused the token: {refusal_text(reply)}")
            offer_pool(channel, pool, timeout=OFFER_TIMEOUT_S)
        except (OSError, TimeoutError, ProtocolError, BrokenError) as exc:
            pool.close()
            if channel is not None:
                channel.close()
            raise BrokenError(
                f"cannot hand a pool to the trainer at {offer.socket} ({exc}); shared memory "
                "needs the same host and user, and the socket's directory reachable (a shared "
                "volume in containers)"
            ) from None
        log.info(
            "pool %s offered to the trainer at %s: %d slots of %.2f MiB = %.1f MiB (memfd)",
            pool.pool_id, offer.socket, pool.slots, layout.stride / MIB, pool.size / MIB,
        )  # fmt: skip
        return pool, channel

    def _too_big(self, offer: ShmOffer, nbytes: int, why: str) -> str:
        return (
            f"the shared-memory pool the trainer asks for needs {nbytes / MIB:.1f} MiB "
            f"({offer.slots} slots) and {why}: give this process or container more memory, or "
            "make the pools smaller on the trainer (lower --queue-mb or --stage-depth, raise "
            "--shm-producers), or use --transport zmq"
        )

    def release(self, pool_id: str, slot: int, gen: int) -> bool:
        """The trainer let go of ``slot``; False for a retired pool or a stale generation."""
        with self._cond:
            pool = self._pool
        if pool is None or pool.pool_id != pool_id:
            return False
        return pool.release(slot, gen)

    def _retire(self) -> None:
        with self._cond:
            pool, channel = self._pool, self._channel
            self._pool, self._channel, self._mode = None, None, PENDING
            if pool is not None and pool is self._writing:
                self._retired.append(pool)
                pool = None
        if channel is not None:
            channel.close()  # the trainer unmaps it once TF is done with its slots
        if pool is not None:
            pool.close()  # wakes an acquire() waiting on it (ClosedError)

    # -- the main loop -----------------------------------------------------------------------

    def acquire(self, timeout: float) -> tuple[SlotPool, int] | None:
        """A WRITING slot of the current pool, or None in ZeroMQ mode. TimeoutError if no slot
        (or no decision yet) within ``timeout``: the caller checks its stop flag and retries."""
        with self._cond:
            if self._mode == PENDING:
                self._cond.wait(timeout)
            if self._mode == ZMQ:
                return None
            pool = self._pool
        if pool is None:
            raise TimeoutError("no pool yet")
        try:
            slot = pool.acquire(timeout=timeout)
        except ClosedError:
            raise TimeoutError("pool retired while waiting") from None
        with self._cond:
            if pool is self._pool:
                self._writing = pool
                return pool, slot
        try:
            pool.discard(slot)  # retired in between (and closed, unless it is still open)
        except (ClosedError, ValueError):
            pass
        raise TimeoutError("pool retired while acquiring")

    def commit(self, pool: SlotPool, slot: int, seq: int) -> dict[str, Any] | None:
        """The slot's descriptor, or None if its pool was retired while it was written (the
        batch is lost with the trainer that pool was for)."""
        try:
            with self._cond:
                current = pool is self._pool
            return pool.commit(slot, seq) if current else None
        except ClosedError:
            return None
        finally:
            self._done_writing(pool)

    def discard(self, pool: SlotPool, slot: int) -> None:
        try:
            pool.discard(slot)
        except (ClosedError, ValueError):
            pass
        finally:
            self._done_writing(pool)

    def _done_writing(self, pool: SlotPool) -> None:
        with self._cond:
            self._writing = None
            retired = pool in self._retired
            if retired:
                self._retired.remove(pool)
        if retired:
            pool.close()

    def close(self) -> None:
        """Idempotent: retire the pool (the trainer keeps what TF still uses)."""
        if self._closed:
            return
        self._closed = True
        self._retire()
        with self._cond:
            retired, self._retired = self._retired, []
        for pool in retired:
            pool.close()
