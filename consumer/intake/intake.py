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
message is logged, booked as ``internal``, and the thread goes on; a batch still returns its
credit and gets its ``dropped`` verdict then (``internal`` is a defect to fix: every check
raises ``ProtocolError``). A failure of a thread itself (socket, TensorFlow) is
carried to the train loop through ``check()``, which raises ``BrokenError``: never a silent
exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from stagefeed.common import protocol
from stagefeed.common.curve import key_fingerprint
from stagefeed.common.errors import BrokenError, ConfigError, DropReason, ProtocolError
from stagefeed.common.ipc_file import IpcFile
from stagefeed.common.ledger import Ledger
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import MIB, TrainerOptions
from stagefeed.common.schema import MAX_ARRAYS, Schema, schema_difference
from stagefeed.common.throttle import LogThrottle
from stagefeed.consumer.intake.availability import Availability
from stagefeed.consumer.intake.connections import Connections
from stagefeed.consumer.intake.frames import receive_message
from stagefeed.consumer.intake.shm_gate import ShmGate
from stagefeed.consumer.intake.socket_events import PeerMonitor

log = logging.getLogger(__name__)

POLL_MS = 100
JOIN_TIMEOUT_S = 3.0
EXPIRE_EVERY_S = 1.0
MAX_LIVE_CONNECTIONS = 256
# (arrays, peer index, seq) -> False if the queue was closed for shutdown.
Enqueue = Callable[[dict[str, Any], int, int], bool]


class Intake:
    """Lifecycle: ``start()`` (bind, start threads) -> ``check()`` from the train loop ->
    ``close()`` (idempotent; call after the FIFOQueue was closed, so no enqueue blocks).
    """

    def __init__(
        self,
        options: TrainerOptions,
        schema: Schema,
        enqueue: Enqueue,
        ledger: Ledger,
        configure_server: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        self.options = options
        self.schema = schema
        self._enqueue = enqueue
        self._ledger = ledger
        self._configure_server = configure_server
        self._curve = configure_server is not None
        self.availability = Availability()
        self.credit_pool = options.recv_threads + 2
        self._conns = Connections(
            self.credit_pool, options.credit_per_producer, MAX_LIVE_CONNECTIONS,
            options.producer_timeout_s,
        )  # fmt: skip
        self._handoff: queue.Queue[tuple[bytes, int, int, dict[str, Any]]] = queue.Queue(
            self.credit_pool
        )
        self._failures: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._granting = threading.Event()  # cleared by stop_granting(): no credit goes out
        self._granting.set()
        self._threads: list[threading.Thread] = []
        self._ctx: zmq.Context | None = None
        self._credit_addr = f"inproc://stagefeed-credit-{id(self)}"
        self._internal_log = LogThrottle()
        self._ipc_file: IpcFile | None = None
        self._delivered_and_ended = False  # a producer that delivered said end (see below)
        self._data_ended = threading.Event()
        self._closed = False
        self.endpoint = ""
        self.shm: ShmGate | None = None

    def start(self) -> Intake:
        """Bind and start the threads; ``ConfigError`` if the address cannot be bound (or, with
        ``transport="shm"``, the pool socket cannot be made)."""
        if self.options.transport != "zmq":
            self.shm = ShmGate.open(self.options, self.schema, self._ledger)
        self._ctx = zmq.Context(io_threads=min(4, self.options.recv_threads))
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.RCVHWM, 2)
        router.setsockopt(zmq.SNDHWM, 64)
        router.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        router.setsockopt(zmq.LINGER, 0)
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
        for i in range(self.options.recv_threads):
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
            self.endpoint, self.schema.describe(), self.options.recv_threads, self.credit_pool,
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
                    self._conns.finished(credits.recv())
                if router in ready:
                    for _ in range(16):  # a bounded burst, then credits and expiry again
                        if not router.poll(0):
                            break
                        self._receive_one(router)
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + EXPIRE_EVERY_S
                    self._expire(router)
                self._send_grants(router)
                self._send_releases(router)
                self._update_data_ended()
            for conn in self._conns.live():
                self._reply(router, conn.routing_id, "bye")
        finally:
            router.close(linger=0)
            credits.close(linger=0)

    def _receive_one(self, router: zmq.Socket) -> None:
        max_frames = 1 + MAX_ARRAYS
        message = receive_message(router, max_frames, self.options.max_message_bytes)
        routing_id = message.routing_id
        user_id = self._user_id(message.frames[0]) if message.frames else None
        try:
            message.check(max_frames, self.options.max_message_bytes)
            self._handle(router, routing_id, message.frames, user_id)
        except ProtocolError as exc:
            conn = self._conns.get(routing_id)
            self._ledger.drop(exc.reason, exc.detail, conn.index if conn else None)
            if exc.kind == "hello":  # the peer is told why, as for any refused hello
                self._reply(router, routing_id, "refused", reason=exc.reason.value,
                            detail=exc.detail)  # fmt: skip
        except Exception:  # noqa: BLE001 - one bad message must not stop the intake
            conn = self._conns.get(routing_id)
            self._ledger.drop(DropReason.INTERNAL, "unexpected error", conn.index if conn else None)
            self._log_internal()

    def _log_internal(self) -> None:
        """Log the exception being handled, in full, at most every few seconds: ``internal``
        is a defect to fix, never a verdict a peer can make the trainer give at will."""
        if self._internal_log.due():
            log.exception("unexpected error while handling a message (dropped)")

    def _user_id(self, frame: zmq.Frame) -> str | None:
        """The CURVE key ZAP admitted this connection with (None without CURVE)."""
        if not self._curve:
            return None
        try:
            return frame.get("User-Id")
        except zmq.ZMQError:
            return None

    def _handle(
        self, router: zmq.Socket, routing_id: bytes, frames: list[zmq.Frame], user_id: str | None
    ) -> None:
        header = protocol.decode_header(frames[0], protocol.FROM_PRODUCER)
        kind = header["t"]
        if kind == "hello":
            self._on_hello(router, routing_id, header, user_id)
            return
        conn = self._conns.get(routing_id)
        if conn is None:
            detail = "this connection has not said hello (trainer restarted?)"
            if kind == "batch":  # the producer can count exactly what was lost
                self._reply(router, routing_id, "dropped", seq=header["seq"],
                            reason=DropReason.NO_HELLO.value, detail=detail)  # fmt: skip
            self._reply(
                router, routing_id, "refused", reason=DropReason.NO_HELLO.value, detail=detail
            )
            raise ProtocolError(DropReason.NO_HELLO, f"{kind} before hello")
        self._conns.seen(conn)
        if kind == "batch":
            self._on_batch(router, conn, header, lambda: protocol.decode_batch(header, frames))
        elif kind == "shm_batch":
            self._on_batch(router, conn, header, lambda: self._shm_batch(conn, header))
        elif kind == "end":  # the producer's bye, and why (protocol.end_reason)
            self._ledger.ended(conn.index, header["seq"], *protocol.end_reason(header))
            self._conns.end(conn)
            if self.shm is not None:
                self.shm.ended(conn.routing_id)
            # Only a producer that delivered can end the data: a peer that said hello and
            # end at once must not stop a trainer that no producer has reached yet.
            if self._ledger.delivered(conn.index):
                self._delivered_and_ended = True

    def _on_hello(
        self, router: zmq.Socket, routing_id: bytes, header: dict, user_id: str | None
    ) -> None:
        name = protocol.check_producer_name(header["name"])
        session = protocol.check_session(header)
        declared = protocol.schema_of_hello(header)
        if declared is not None and declared != self.schema:
            detail = schema_difference(self.schema, declared)
            self._ledger.refused(name, DropReason.SPEC_MISMATCH.value, detail)
            self._reply(
                router, routing_id, "refused", reason=DropReason.SPEC_MISMATCH.value, detail=detail
            )
            return
        conn = self._conns.get(routing_id)
        if conn is None:
            index = None if self._conns.full() else self._ledger.open(
                name if user_id is None else f"{name} {key_fingerprint(user_id)}", session
            )
            if index is None:
                detail = f"the trainer serves {MAX_LIVE_CONNECTIONS} connections at most"
                self._ledger.refused(name, DropReason.PEER_LIMIT.value, detail)
                self._reply(
                router, routing_id, "refused", reason=DropReason.PEER_LIMIT.value, detail=detail
            )
                return
            conn = self._conns.add(routing_id, index, name)
        self._conns.seen(conn)
        granting = self._granting.is_set()
        grants = dict((c.routing_id, n) for c, n in self._conns.grants()) if granting else {}
        credit = grants.pop(routing_id, 0)
        wants_shm = self.shm is not None and header.get("shm") is True
        shm = self.shm.offer(routing_id, conn.index) if wants_shm else {}
        self._reply(
            router, routing_id, "welcome", schema=self.schema.to_dict(),
            max_message=self.options.max_message_bytes, credit=credit, **shm,
        )  # fmt: skip
        for rid, n in grants.items():
            self._reply(router, rid, "credit", n=n)

    def _on_batch(
        self, router: zmq.Socket, conn, header: dict, decode: Callable[[], protocol.Batch]
    ) -> None:
        seq = header["seq"]
        if not self._conns.use_credit(conn):
            self._refuse_batch(router, conn, seq, DropReason.NO_CREDIT, "sent without credit")
            return
        # From here the batch holds a credit: however its checks fail, the credit returns
        # and the producer gets a verdict.
        try:
            batch = decode()
            protocol.check_against_schema(batch, self.schema)
        except ProtocolError as exc:
            self._conns.finished(conn.routing_id)
            self._refuse_batch(router, conn, seq, exc.reason, exc.detail)
            return
        except Exception:  # noqa: BLE001 - a defect: logged, and the batch still answered
            self._log_internal()
            self._conns.finished(conn.routing_id)
            self._refuse_batch(router, conn, seq, DropReason.INTERNAL, "unexpected error")
            return
        reason = self._ledger.accept(conn.index, seq, batch.nbytes)
        if reason is not None:
            self._conns.finished(conn.routing_id)
            self._reply(router, conn.routing_id, "dropped", seq=seq, reason=reason.value,
                        detail=f"seq {seq}")  # fmt: skip
            return
        if header["t"] == "shm_batch":
            self.shm.batches += 1
        self._handoff.put_nowait((conn.routing_id, conn.index, seq, batch.arrays))

    def _shm_batch(self, conn, header: dict) -> protocol.Batch:
        if self.shm is None:
            raise ProtocolError(DropReason.SHM_POOL, "this trainer maps no pools (--transport zmq)")
        return self.shm.batch(conn.routing_id, header)

    def _send_releases(self, router: zmq.Socket) -> None:
        """Slots TensorFlow let go of, back to their producers (the finalizers queued them)."""
        if self.shm is None:
            return
        for routing_id, pool, slot, gen in self.shm.releases():
            self._reply(router, routing_id, "release", pool=pool, slot=slot, gen=gen)

    def _refuse_batch(self, router, conn, seq: int, reason: DropReason, detail: str) -> None:
        self._ledger.drop(reason, f"producer {conn.name}: {detail}", conn.index)
        self._reply(
            router, conn.routing_id, "dropped", seq=seq, reason=reason.value, detail=detail
        )

    def data_ended(self) -> bool:
        """True once a producer that delivered (a valid batch booked on its connection, or on
        an earlier connection of its run) said ``end``, every live connection has said
        ``end``, and every batch received has left the intake (enqueued or dropped). An
        ``end`` from a connection that delivered nothing ends nothing: a run that has
        received no batch never ends for lack of data (docs/guarantees.md).
        """
        return self._data_ended.is_set()

    def _update_data_ended(self) -> None:
        live = self._conns.live()
        ended = (
            self._delivered_and_ended
            and all(c.ended for c in live)
            and self._conns.available == self.credit_pool
        )
        if ended:
            self._data_ended.set()
        else:
            self._data_ended.clear()

    def _expire(self, router: zmq.Socket) -> None:
        for conn in self._conns.revoke_hoarded():
            log.info("producer %s held credit unused for %.0f s while others waited: revoked",
                     conn.name, self._conns.timeout_s)  # fmt: skip
            self._reply(router, conn.routing_id, "refused", reason=DropReason.NO_HELLO.value,
                        detail="credit unused while others waited: say hello again")  # fmt: skip
            self._ledger.forget_if_idle(conn.index)
        for conn in self._conns.expire():
            if self.shm is not None:
                self.shm.forget(conn.routing_id)
            if self._ledger.forget_if_idle(conn.index):
                log.debug("connection %s went away without delivering", conn.name)
            elif not conn.ended:
                log.info("producer %s silent for %.0f s: forgotten", conn.name,
                         self._conns.timeout_s)  # fmt: skip

    def stop_granting(self) -> None:
        """Grant no more credit (before the queue closes): at most the credit pool is then
        received and not enqueued at stop.
        """
        self._granting.clear()

    def _send_grants(self, router: zmq.Socket) -> None:
        if not self._granting.is_set():
            return
        for conn, n in self._conns.grants():
            self._reply(router, conn.routing_id, "credit", n=n)

    @staticmethod
    def _reply(router: zmq.Socket, routing_id: bytes, kind: str, **fields: Any) -> None:
        # ROUTER drops a message to a peer that is gone or full: a reply can never block.
        try:
            router.send_multipart([routing_id, protocol.encode_control(kind, **fields)],
                                  flags=zmq.NOBLOCK)  # fmt: skip
        except zmq.Again:
            pass

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
