"""The trainer's shared-memory side: pools offered over a unix socket, descriptors checked
against them, and TensorFlow's releases routed back to the producer that owns the slot.

Threads:

- ``stagefeed-shm-pools`` owns the ``FdListener`` and every producer's fd channel (one
  ``poll``): it accepts connections (SO_PEERCRED: same uid only), reads the welcome token,
  then the pool offer, maps the pool read-only, and removes it when the channel reaches EOF.
- The intake thread calls ``offer`` (fields of a welcome), ``batch`` (a ``shm_batch`` message
  to read-only views), ``releases`` (what to send back) and ``forget``.
- Finalizers run in whatever thread drops the last view of a slot (TensorFlow's, inside a
  ``session.run``): ``_released`` only puts on a ``SimpleQueue`` and writes a wake-up byte that
  the intake's poll sees. It never blocks and tolerates a gate already closed.

Invariants:

- a pool belongs to the ZeroMQ connection whose welcome token it was offered with; a
  descriptor arriving on any other connection is refused (``shm_pool``), so no producer can
  name another's slots. A token is good for one offer, and only while its connection lives.
- one pool per connection: an accepted offer replaces the connection's older pool (removed
  from the table; views still alive keep its memory mapped until they die).
- a pool leaves the table once its channel reached EOF (its producer exited, was killed, or
  retired the pool after a new welcome) *and* no descriptor of it can still arrive: its
  connection sent ``end``, was forgotten (silent for ``producer_timeout_s``), or offered a
  newer pool. Until then the pool stays readable, so a batch described just before its
  producer stopped (still in ZeroMQ while the EOF came first) is trained, not dropped.
  Releases for a pool that left are not sent.
- every refusal is booked in the ledger under its reason (``shm_*``, ``spec_mismatch``),
  against the connection when it is known.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import queue
import secrets
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from stagefeed.common import protocol
from stagefeed.common.errors import BrokenError, ConfigError, DropReason, ProtocolError
from stagefeed.common.excerpt import excerpt
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import Schema
from stagefeed.common.shm.fd_passing import FdChannel, FdListener, accept_pool
from stagefeed.common.shm.layout import MIB, PoolAnnounce, SlotLayout
from stagefeed.common.shm.mapped import Descriptor, MappedPool, PoolTable
from stagefeed.common.shm.sizing import PoolSizing
from stagefeed.common.throttle import LogThrottle
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.shm_config import default_socket_path

log = logging.getLogger(__name__)

THREAD_NAME = "stagefeed-shm-pools"
POLL_MS = 100
HANDSHAKE_S = 10.0  # a channel must present its token and offer within this
MAX_POOLS = 64
MAX_CHANNELS = 2 * MAX_POOLS
JOIN_TIMEOUT_S = 3.0


class PeerState(enum.Enum):
    """Where one producer's fd channel is in its handshake; it only moves forward."""

    TOKEN = "token"  # accepted: waiting for the welcome token of its ZeroMQ connection
    OFFER = "offer"  # the token matched: waiting for the pool offer (and its descriptor)
    LIVE = "live"  # the pool is mapped; any further message on the channel is refused


@dataclasses.dataclass
class _Peer:
    """One fd channel and its ``PeerState``."""

    channel: FdChannel
    since: float
    state: PeerState = PeerState.TOKEN
    routing_id: bytes | None = None
    index: int | None = None
    slots: int = 0
    pool_id: str | None = None


class ShmGate:
    """Lifecycle: ``open(...)`` (listen; None for ``auto`` when it cannot) -> ``start()`` ->
    calls from the intake thread -> ``close()`` (idempotent: stops the thread, removes the
    socket, unmaps every pool once its views are gone)."""

    def __init__(
        self, listener: FdListener, layout: SlotLayout, sizing: PoolSizing, ledger: Ledger
    ) -> None:
        self.listener = listener
        self.path = listener.path
        self.layout = layout
        self.sizing = sizing
        self._ledger = ledger
        self._table = PoolTable(MAX_POOLS)  # pools and their owners (routing ids)
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[bytes, int]] = {}  # token -> (routing id, ledger index)
        self._token_of: dict[bytes, str] = {}
        # Pools at EOF whose connection may still deliver descriptors (routing id -> pool), and
        # connections with a pool that can deliver none any more (ended or forgotten).
        self._closing: dict[bytes, str] = {}
        self._done: set[bytes] = set()
        self._released: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._wake_lock = threading.RLock()  # a finalizer may run while this thread holds it
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_w: int | None = wake_w
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._peers: dict[int, _Peer] = {}
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._failure: Callable[[BaseException], None] = lambda exc: None
        self._internal_log = LogThrottle()
        self.pools_accepted = 0
        self.batches = 0  # shm batches the intake accepted (its thread counts them)
        self._closed = False

    @classmethod
    def open(cls, options: TrainerOptions, schema: Schema, ledger: Ledger) -> ShmGate | None:
        """Listen for pools as ``options.transport`` says: ``ConfigError`` for ``shm`` if the
        socket cannot be made (naming the path and the fix); ``None`` (logged) for ``auto``."""
        path = options.shm_socket or default_socket_path(options.bind)
        layout = SlotLayout.of(schema.wire())  # the schema's names, dtypes and shapes fit
        try:
            listener = FdListener(path)
        except (ConfigError, OSError) as exc:
            problem = (
                f"cannot offer shared memory at {path}: {exc}; pass --shm-socket PATH (a "
                "directory only this user can enter), or --transport zmq"
            )
            if options.transport == "shm":
                raise ConfigError(problem) from None
            log.warning("%s; batches come over ZeroMQ only", problem)
            return None
        sizing = PoolSizing.for_trainer(
            options.queue_capacity, options.stage_depth, options.credit_per_producer,
            options.shm_producers, layout.stride,
        )  # fmt: skip
        return cls(listener, layout, sizing, ledger)

    @property
    def wake_fd(self) -> int:
        """Readable when releases are waiting (register it in the intake's poll)."""
        return self._wake_r

    def start(self, on_failure: Callable[[BaseException], None]) -> ShmGate:
        self._failure = on_failure
        self._thread.start()
        log.info("shared memory: pools offered at %s; %s", self.path, self.sizing.describe())
        return self

    # -- the intake thread -------------------------------------------------------------------

    def offer(self, routing_id: bytes, index: int) -> dict[str, Any]:
        """Welcome fields for a connection whose hello said ``shm``: a fresh token replaces any
        earlier one of the connection."""
        token = secrets.token_hex(16)
        with self._lock:
            self._done.discard(routing_id)  # said hello again: it may send descriptors
            old = self._token_of.pop(routing_id, None)
            self._tokens.pop(old, None)
            self._tokens[token] = (routing_id, index)
            self._token_of[routing_id] = token
        return {"shm_socket": self.path, "shm_token": token, "shm_slots": self.sizing.slots}

    def forget(self, routing_id: bytes) -> None:
        """The connection was forgotten: its token is void, and its pool leaves at EOF (at
        once if that came already)."""
        with self._lock:
            self._tokens.pop(self._token_of.pop(routing_id, ""), None)
        self._no_more_descriptors(routing_id)

    def ended(self, routing_id: bytes) -> None:
        """The connection sent ``end``: its pool leaves at EOF (at once if that came already)."""
        self._no_more_descriptors(routing_id)

    def _no_more_descriptors(self, routing_id: bytes) -> None:
        with self._lock:
            closing = self._closing.get(routing_id)
            if closing is None and self._table.pool_of(routing_id) is not None:
                self._done.add(routing_id)
        if closing is not None:
            self._retire(routing_id, closing)

    def batch(self, routing_id: bytes, header: dict[str, Any]) -> protocol.Batch:
        """The read-only views of a ``shm_batch`` received on ``routing_id``'s connection;
        ProtocolError (``shm_*``) if the descriptor is not a current slot of its own pool."""
        desc = Descriptor.parse(header["desc"])
        if desc.seq != header["seq"]:
            raise ProtocolError(
                DropReason.SHM_DESCRIPTOR, f"descriptor seq {desc.seq}, message seq {header['seq']}"
            )
        views = self._table.view(desc, routing_id)
        return protocol.Batch(desc.seq, views, sum(spec.nbytes for spec in self.layout.arrays))

    def releases(self) -> list[tuple[bytes, str, int, int]]:
        """``(routing id, pool, slot, gen)`` of every slot TF released since the last call,
        for pools still live (the others' producers no longer care)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                pool_id, slot, gen = self._released.get_nowait()
            except queue.Empty:
                break
            owner = self._table.owner(pool_id)
            if isinstance(owner, bytes):
                out.append((owner, pool_id, slot, gen))
        return out

    def stats(self) -> dict[str, Any]:
        """The summary's ``shm`` entry."""
        return {
            "socket": self.path,
            "slots_per_pool": self.sizing.slots,
            "slot_mb": round(self.sizing.stride / MIB, 3),
            "pool_mb": round(self.sizing.pool_bytes / MIB, 1),
            "sized_for_producers": self.sizing.producers,
            "pools_accepted": self.pools_accepted,
            "pools_live": len(self._table.ids()),
            "batches": self.batches,
        }

    # -- finalizers (any thread) -------------------------------------------------------------

    def _on_release(self, pool_id: str, slot: int, gen: int) -> None:
        self._released.put((pool_id, slot, gen))
        with self._wake_lock:
            if self._wake_w is not None:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:
                    pass  # full of wake-ups already

    # -- the pools thread --------------------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self.listener.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        try:
            while True:
                for fd, _events in poller.poll(POLL_MS):
                    if fd == self._stop_r:
                        return
                    if fd == self.listener.fileno():
                        self._accept(poller)
                    elif fd in self._peers:
                        self._service(poller, self._peers[fd])
                self._expire(poller)
        except Exception as exc:  # noqa: BLE001 - carried to the train loop via the intake
            log.exception("%s failed", THREAD_NAME)
            self._failure(exc)
        finally:
            for peer in list(self._peers.values()):
                peer.channel.close()
            self._peers.clear()

    def _accept(self, poller: select.poll) -> None:
        try:
            channel = self.listener.accept(timeout=0.5)
        except TimeoutError:
            return
        except ProtocolError as exc:  # another uid
            self._ledger.drop(exc.reason, f"fd socket: {exc.detail}")
            return
        if len(self._peers) >= MAX_CHANNELS:
            channel.close()
            self._ledger.drop(DropReason.SHM_FD, f"over {MAX_CHANNELS} fd channels")
            return
        self._peers[channel.fileno()] = _Peer(channel, time.monotonic())
        poller.register(channel.fileno(), select.POLLIN)

    def _service(self, poller: select.poll, peer: _Peer) -> None:
        try:
            if peer.state is PeerState.TOKEN:
                self._on_token(peer)
            elif peer.state is PeerState.OFFER:
                self._on_offer(peer)
            else:
                header, fd = peer.channel.recv(timeout=0)
                if fd is not None:
                    os.close(fd)
                keys = sorted(excerpt(k, 20) for k in header)[:4]
                raise ProtocolError(DropReason.SHM_FD, f"message after the offer, keys {keys}")
        except BrokenError:  # EOF: the producer closed the channel, exited or died
            self._drop_peer(poller, peer)
        except ProtocolError as exc:
            self._ledger.drop(exc.reason, f"fd socket: {exc.detail}", peer.index)
            if peer.state is not PeerState.LIVE:
                self._drop_peer(poller, peer)
        except TimeoutError:
            pass  # woken without a whole message
        except Exception:  # noqa: BLE001 - a defect; one peer's message must not end the thread
            self._ledger.drop(DropReason.INTERNAL, "fd socket: unexpected error", peer.index)
            if self._internal_log.due():
                log.exception("unexpected error on the fd channel of pid %d (channel closed)",
                              peer.channel.peer.pid)  # fmt: skip
            self._drop_peer(poller, peer)

    def _on_token(self, peer: _Peer) -> None:
        header, fd = peer.channel.recv(timeout=0)
        if fd is not None:
            os.close(fd)
        token = header.get("token")
        with self._lock:
            found = self._tokens.pop(token, None) if isinstance(token, str) else None
            if found is not None:
                del self._token_of[found[0]]
        if found is None:
            detail = f"no live connection has this token (pid {peer.channel.peer.pid})"
            peer.channel.send({"ok": False, "reason": DropReason.SHM_TOKEN.value, "detail": detail})
            raise ProtocolError(DropReason.SHM_TOKEN, detail)
        peer.routing_id, peer.index = found
        peer.slots, peer.state = self.sizing.slots, PeerState.OFFER
        peer.channel.send({"ok": True})

    def _check(self, announce: PoolAnnounce) -> None:
        if announce.layout != self.layout:
            got, expected = announce.layout.to_wire(), self.layout.to_wire()
            raise ProtocolError(
                DropReason.SPEC_MISMATCH, f"pool layout {got!r:.200}, expected {expected!r:.200}"
            )
        if announce.slots > self.sizing.slots:
            raise ProtocolError(
                DropReason.SHM_POOL_SIZE, f"{announce.slots} slots, granted {self.sizing.slots}"
            )
        self._table.admit(announce.pool_id)

    def _on_offer(self, peer: _Peer) -> None:
        def register(mapped: MappedPool) -> None:  # before the producer hears "ok"
            self._register(peer, mapped)

        mapped = accept_pool(
            peer.channel, self._on_release, timeout=0, check=self._check, register=register
        )
        log.info(
            "pool %s of pid %d mapped: %d slots, %.1f MiB", mapped.pool_id,
            peer.channel.peer.pid, mapped.slots, mapped.announce.size / MIB,
        )  # fmt: skip

    def _register(self, peer: _Peer, mapped: MappedPool) -> None:
        assert peer.routing_id is not None
        with self._lock:
            self._closing.pop(peer.routing_id, None)  # its descriptors now name the new pool
            self._done.discard(peer.routing_id)
        self._table.add(mapped, peer.routing_id)  # retires the connection's older pool
        peer.pool_id, peer.state = mapped.pool_id, PeerState.LIVE
        self.pools_accepted += 1

    def _drop_peer(self, poller: select.poll, peer: _Peer) -> None:
        poller.unregister(peer.channel.fileno())
        del self._peers[peer.channel.fileno()]
        peer.channel.close()
        if peer.pool_id is None:
            return
        assert peer.routing_id is not None
        with self._lock:
            current = self._table.owner(peer.pool_id) == peer.routing_id
            keep = current and peer.routing_id not in self._done
            if keep:
                self._closing[peer.routing_id] = peer.pool_id
        if keep:
            log.info("pool %s: its producer closed the channel; readable until its connection "
                     "ends (batches may still be on their way)", peer.pool_id)  # fmt: skip
            return
        self._retire(peer.routing_id, peer.pool_id)

    def _retire(self, routing_id: bytes, pool_id: str) -> None:
        """The pool leaves the table (unmapped once TF is done with its slots). Idempotent."""
        with self._lock:
            removed = self._table.remove(pool_id, routing_id)
            if removed:
                self._closing.pop(routing_id, None)
                self._done.discard(routing_id)
        if removed:
            log.info("pool %s: its producer closed it; unmapped once TF is done", pool_id)

    def _expire(self, poller: select.poll) -> None:
        now = time.monotonic()
        for peer in [p for p in self._peers.values() if p.state is not PeerState.LIVE]:
            if now - peer.since > HANDSHAKE_S:
                self._ledger.drop(DropReason.SHM_FD, f"no offer in {HANDSHAKE_S:.0f} s", peer.index)
                self._drop_peer(poller, peer)

    def close(self) -> None:
        """Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            os.write(self._stop_w, b"\0")
            join_threads([self._thread], JOIN_TIMEOUT_S)
        self.listener.close()
        self._table.close()
        with self._wake_lock:
            wake_w, self._wake_w = self._wake_w, None
        for fd in (self._wake_r, wake_w, self._stop_r, self._stop_w):
            if fd is not None:
                os.close(fd)
