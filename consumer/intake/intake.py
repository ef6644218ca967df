"""The trainer's intake: one ROUTER socket, one thread that owns it, K threads that enqueue.

::

    producers (DEALER) ──tcp/ipc──▶ ROUTER ─ stagefeed-intake ─▶ hand-off (bounded) ─▶
        stagefeed-enqueue-0..K-1 ─▶ enqueue(arrays, peer, seq) (FIFOQueue) ─▶ credit back

With ``--transport shm|auto`` a ``shm_batch`` carries a slot descriptor instead of frames
(``consumer.intake.shm_gate``): the intake checks it, hands the enqueue threads read-only views of
the producer's slot exactly like decoded frames, and sends ``release`` to the owning
connection once TensorFlow has dropped the last tensor using the slot (the gate's wake-up
fd is in this thread's poll). Credit paces both kinds alike.

The intake thread is the only user of the ROUTER socket. It reads each message frame by frame
(``consumer.intake.frames``), keeping at most ``1 + MAX_ARRAYS`` frames and ``max_message_bytes``;
anything beyond is drained, not kept, and dropped. It never blocks on anything but ``poll``: batches
go to the hand-off, whose capacity is the credit pool, so a put cannot block (every batch in
it holds a credit). Control messages are answered at once, also while the queue is full.

Errors: a message that fails a check is dropped, booked by reason, and its producer is told
(``dropped`` for a batch, ``refused`` for a hello). Any other exception while handling one
message is logged, booked as ``internal``, and the thread goes on; the peer is told (a batch
returns its credit and gets its ``dropped`` verdict, any other message ``refused``:
``Dispatch.handle``), so no producer waits for a reply that never comes (``internal`` is a
defect to fix: every check raises ``ProtocolError``). A failure of a thread itself (socket,
TensorFlow) is carried to the train loop through ``check()``, which raises ``BrokenError``:
never a silent exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from stagefeed.common import liveness
from stagefeed.common.errors import BrokenError, ConfigError, DropReason, ProtocolError
from stagefeed.common.ipc_file import IpcFile
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import MIB, TrainerOptions
from stagefeed.common.schema import MAX_ARRAYS, Schema
from stagefeed.common.tf_config import NO_CLUSTER, ClusterPlace
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.availability import Availability
from stagefeed.consumer.intake.dispatch import Dispatch, Handoff
from stagefeed.consumer.intake.frames import receive_message
from stagefeed.consumer.intake.shm_gate import ShmGate
from stagefeed.consumer.intake.socket_events import PeerMonitor

log = logging.getLogger(__name__)

POLL_MS = 100
JOIN_TIMEOUT_S = 3.0
# How long the last messages (``saved``, ``bye``) may take to reach live producers at close,
# and how long a closing intake waits for the ``leaving`` of producers it let go (``saved``, or
# the ``bye`` of a finished run).
BYE_LINGER_MS = 500
LEAVING_WAIT_S = 2.0
EXPIRE_EVERY_S = 1.0
# (arrays, peer index, seq) -> False if the queue was closed for shutdown.
Enqueue = Callable[[dict[str, Any], int, int], bool]


class Intake:
    """Lifecycle: ``start()`` (bind, start threads) -> ``check()`` from the train loop ->
    ``close()`` (idempotent; call after the FIFOQueue was closed, so no enqueue blocks).
    ``place``: the trainer's in a ``TF_CONFIG`` cluster, resolved where it was made (a
    cluster worker's intake refuses a source with passes); default no cluster.
    """

    def __init__(
        self,
        options: TrainerOptions,
        schema: Schema,
        enqueue: Enqueue,
        ledger: Ledger,
        configure_server: Callable[[zmq.Socket], None] | None = None,
        *,
        place: ClusterPlace = NO_CLUSTER,
    ) -> None:
        self.options = options
        self.place = place  # the trainer's, in a TF_CONFIG cluster: its rules (Dispatch)
        self.schema = schema
        self._enqueue = enqueue
        self._ledger = ledger
        self._configure_server = configure_server
        self._curve = configure_server is not None
        self.availability = Availability()
        self.credit_pool = options.enqueue_threads + 2
        self._handoff: Handoff = queue.Queue(self.credit_pool)
        self._dispatch: Dispatch | None = None  # made in start(), with the shm gate
        self._failures: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ctx: zmq.Context | None = None
        self._credit_addr = f"inproc://stagefeed-credit-{id(self)}"
        self._ipc_file: IpcFile | None = None
        self._closed = False
        self.endpoint = ""
        self.shm: ShmGate | None = None

    def start(self) -> Intake:
        """Bind and start the threads; ``ConfigError`` if the address cannot be bound (or, with
        ``transport="shm"``, the pool socket cannot be made)."""
        if self.options.transport != "zmq":
            self.shm = ShmGate.open(self.options, self.schema, self._ledger)
        self._dispatch = Dispatch(
            self.options, self.schema, self._ledger, self._handoff, self.credit_pool, self.shm,
            self.place, lambda: self.availability.enqueued,
        )
        self._ctx = zmq.Context(io_threads=min(4, self.options.enqueue_threads))
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.RCVHWM, 2)
        router.setsockopt(zmq.SNDHWM, 64)
        router.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        router.setsockopt(zmq.LINGER, 0)
        # Heartbeats and keepalive: a producer that vanishes is noticed (common/liveness.py).
        liveness.configure(router, liveness.heartbeat_timeout_s(self.options.max_message_bytes))
        if self._configure_server is not None:
            self._configure_server(router)
        peers = PeerMonitor(router, self._ledger, self._stop, self._failures.put)
        try:
            router.bind(self.options.bind)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            peers.abandon()
            self._close_configurator()
            self._ctx.term()
            if self.shm is not None:
                self.shm.close()
            raise ConfigError(f"cannot bind {self.options.bind!r}: {exc}") from None
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_file = IpcFile(self.endpoint)
        credits = self._ctx.socket(zmq.PULL)
        credits.setsockopt(zmq.LINGER, 0)
        credits.bind(self._credit_addr)
        self._threads.append(
            threading.Thread(
                target=self._guard, args=(self._serve, router, credits), name="stagefeed-intake"
            )
        )
        self._threads.append(peers.thread)
        for i in range(self.options.enqueue_threads):
            self._threads.append(
                threading.Thread(
                    target=self._guard, args=(self._drain,), name=f"stagefeed-enqueue-{i}"
                )
            )
        for thread in self._threads:
            thread.daemon = True  # a last resort only: close() joins them with a deadline
            thread.start()
        if self.shm is not None:
            self.shm.start(self._failures.put)
        log.info(
            "listening on %s: %s; %d enqueue threads, %d credits (%.1f MiB in flight at most)",
            self.endpoint, self.schema.describe(), self.options.enqueue_threads, self.credit_pool,
            self.credit_pool * self.schema.batch_bytes / MIB,
        )  # fmt: skip
        return self

    def check(self) -> None:
        """Raise ``BrokenError`` if a thread of the intake failed."""
        try:
            exc = self._failures.get_nowait()
        except queue.Empty:
            return
        self._failures.put(exc)  # every later check fails too
        raise BrokenError(f"intake thread failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self._closed or self._ctx is None:
            return
        self._closed = True
        self._stop.set()
        stuck = join_threads(self._threads, JOIN_TIMEOUT_S)
        stuck += self._close_configurator()
        if stuck:
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()
        if self._ipc_file is not None:
            self._ipc_file.remove()
        if self.shm is not None:
            self.shm.close()

    def _close_configurator(self) -> list[str]:
        """Stop what the socket configurator runs (CURVE's authenticator): before ``term``."""
        close = getattr(self._configure_server, "close", None)
        return close() if close is not None else []

    def _guard(self, target: Callable[..., None], *args: Any) -> None:
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: carried via check()
            if not self._stop.is_set():
                log.exception("%s failed", threading.current_thread().name)
                self._failures.put(exc)

    # -- the intake thread -------------------------------------------------------------------

    def _serve(self, router: zmq.Socket, credits: zmq.Socket) -> None:
        assert self._dispatch is not None
        dispatch, conns = self._dispatch, self._dispatch.conns
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(credits, zmq.POLLIN)
        if self.shm is not None:
            poller.register(self.shm.wake_fd, zmq.POLLIN)
        next_expiry = time.monotonic() + EXPIRE_EVERY_S
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                while credits in ready and credits.poll(0):
                    conns.finished(credits.recv())
                if router in ready:
                    for _ in range(16):  # a bounded burst, then credits and expiry again
                        if not router.poll(0):
                            break
                        self._receive_one(router)
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + EXPIRE_EVERY_S
                    dispatch.expire(router)
                dispatch.send_passes(router)  # before grants: next_pass zeroes credit
                dispatch.send_grants(router)
                dispatch.send_releases(router)
                dispatch.send_saved(router)
                dispatch.update_data_ended()
            dispatch.send_saved(router)  # the final checkpoint's, written just before
            for conn in conns.live():
                dispatch.send_bye(router, conn)
            leaving_by = time.monotonic() + LEAVING_WAIT_S
            while dispatch.awaiting_leaving() and time.monotonic() < leaving_by:
                if router.poll(POLL_MS):
                    self._receive_one(router)
            router.close(linger=BYE_LINGER_MS)
        finally:
            router.close(linger=0)
            credits.close(linger=0)

    def _receive_one(self, router: zmq.Socket) -> None:
        assert self._dispatch is not None
        dispatch = self._dispatch
        max_frames = 1 + MAX_ARRAYS
        message = receive_message(router, max_frames, self.options.max_message_bytes)
        routing_id = message.routing_id
        user_id = self._user_id(message.frames[0]) if message.frames else None
        try:
            message.check(max_frames, self.options.max_message_bytes)
            dispatch.handle(router, routing_id, message.frames, user_id)
        except ProtocolError as exc:
            conn = dispatch.conns.get(routing_id)
            self._ledger.drop(exc.reason, exc.detail, conn.index if conn else None)
            if exc.kind == "hello":  # the peer is told why, as for any refused hello
                dispatch.reply(router, routing_id, "refused", reason=exc.reason.value,
                               detail=exc.detail)  # fmt: skip
        except Exception:  # noqa: BLE001 - one bad message must not stop the intake
            conn = dispatch.conns.get(routing_id)
            self._ledger.drop(DropReason.INTERNAL, "unexpected error", conn.index if conn else None)
            dispatch.log_internal()

    def _user_id(self, frame: zmq.Frame) -> str | None:
        """The CURVE key ZAP admitted this connection with (None without CURVE)."""
        if not self._curve:
            return None
        try:
            return frame.get("User-Id")
        except zmq.ZMQError:
            return None

    def data_ended(self) -> bool:
        """``Dispatch.data_ended``: every producer that delivered said ``end`` and every batch
        received has left the intake (docs/guarantees.md). False before ``start``."""
        return self._dispatch is not None and self._dispatch.data_ended()

    @property
    def passes(self) -> Any:
        """The ``PassBooks`` (None before ``start``)."""
        return self._dispatch.passes if self._dispatch is not None else None

    def stop_granting(self) -> None:
        """Grant no more credit (before the queue closes): at most the credit pool is then
        received and not enqueued at stop."""
        if self._dispatch is not None:
            self._dispatch.stop_granting()

    # -- the enqueue threads -----------------------------------------------------------------

    def _drain(self) -> None:
        assert self._ctx is not None
        credits = self._ctx.socket(zmq.PUSH)
        credits.setsockopt(zmq.LINGER, 0)
        credits.connect(self._credit_addr)
        try:
            while not self._stop.is_set():
                try:
                    routing_id, index, seq, arrays = self._handoff.get(timeout=POLL_MS / 1000)
                except queue.Empty:
                    continue
                try:
                    if self._enqueue(arrays, index, seq):
                        self._ledger.enqueued(index)
                        self.availability.add()
                finally:
                    del arrays  # a shared-memory slot must not outlive what TF holds of it
                    # Never blocks: after stop the intake may have closed its end already, and
                    # the credit no longer matters then.
                    try:
                        credits.send(routing_id, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            credits.close(linger=0)
