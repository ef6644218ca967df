"""What each producer message does to the trainer's state: the protocol's rules, in one place.

``Dispatch`` runs on the intake thread only (``consumer.intake.intake`` owns the socket and the
threads and hands it each received message); nothing here blocks. It admits hellos
(schema, connection limit, credit and, with shared memory, a pool token), checks batches and
gives each a verdict, books ``end`` with its reason, grants credit, routes slot releases back,
forgets silent connections, and keeps the end-of-data rule (``data_ended``) and the end of a
pass (``send_passes``: producers whose sources make passes, ``consumer.intake.passes``).
What a shard's producer may say (who carries a shard, what settles the shard count, whose
ends count) is ``consumer.intake.claims``.
A producer welcomed with ``confirm`` that said ``end`` is told ``saved`` once a complete
checkpoint holds its whole shard (``send_saved``, ``ShardBooks.saved_end``).

Invariants: a batch that took a credit returns it whatever its checks say, and its producer
gets a verdict (``dropped`` with the reason) unless it was handed to the enqueue threads; a
refused hello is answered with ``refused`` and the reason; every drop is booked by reason.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq

from stagefeed.common import protocol
from stagefeed.common.curve import key_fingerprint
from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import MAX_SEQ
from stagefeed.common.schema import Schema, schema_difference
from stagefeed.common.tf_config import ClusterPlace
from stagefeed.common.throttle import LogThrottle
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.claims import Shards
from stagefeed.consumer.intake.connections import Connection, Connections
from stagefeed.consumer.intake.frames import reply
from stagefeed.consumer.intake.passes import PassBooks
from stagefeed.consumer.intake.shm_gate import ShmGate

log = logging.getLogger(__name__)

MAX_LIVE_CONNECTIONS = 256
# A batch for the enqueue threads: (routing id, ledger index, seq, arrays).
Handoff = queue.Queue[tuple[bytes, int, int, dict[str, Any]]]


class Dispatch:
    """The intake thread's handling of messages (see the module docstring)."""

    def __init__(
        self,
        options: TrainerOptions,
        schema: Schema,
        ledger: Ledger,
        handoff: Handoff,
        credit_pool: int,
        shm: ShmGate | None,
        place: ClusterPlace,
        enqueued: Callable[[], int] = lambda: 0,
    ) -> None:
        self.options = options
        self.schema = schema
        self._ledger = ledger
        self._handoff = handoff
        self.credit_pool = credit_pool
        self.shm = shm
        self.conns = Connections(
            credit_pool, options.credit_per_producer, MAX_LIVE_CONNECTIONS,
            options.producer_timeout_s,
        )  # fmt: skip
        self._granting = threading.Event()  # cleared by stop_granting(): no credit goes out
        self._granting.set()
        self._internal_log = LogThrottle()
        self._delivered_and_ended = False  # a producer that delivered said end (see below)
        self._data_ended = threading.Event()
        # A cluster worker sees only its own shards, and a pass ends when every shard ended it.
        no_passes = (
            f"a source with passes feeds one trainer; this one is a worker of a cluster of "
            f"{place.count} (TF_CONFIG): give the source no passes (docs/resume.md)"
            if place.in_cluster else ""
        )  # fmt: skip
        resumed = ledger.shards.resumed if ledger.shards is not None else None
        self.passes = PassBooks(options.epochs, resumed)
        self.shards = Shards(ledger, self.passes, self.conns, no_passes, self._forget,
                             schema.batch_size)  # fmt: skip
        self._enqueued = enqueued  # batches enqueued so far (``Availability.enqueued``)
        # Ended connections welcomed with ``confirm``, not yet told ``saved``: (shard, end).
        self._unconfirmed: dict[bytes, tuple[int, int]] = {}
        self._saves_seen = -1
        self._told_saved: set[bytes] = set()  # told ``saved``, no ``leaving`` yet

    def log_internal(self) -> None:
        """Log the exception being handled, in full, at most every few seconds: ``internal``
        is a defect to fix, never a verdict a peer can make the trainer give at will."""
        if self._internal_log.due():
            log.exception("unexpected error while handling a message (dropped)")

    def handle(
        self, router: zmq.Socket, routing_id: bytes, frames: list[zmq.Frame], user_id: str | None
    ) -> None:
        """Handle one decoded message; a check that fails raises ``ProtocolError`` (the intake
        books and answers it). Any other exception is a defect met on this peer's message: it
        is logged (throttled), booked as ``internal`` and answered (``_failed``), never silence
        that leaves the producer waiting; the intake goes on."""
        header = protocol.decode_header(frames[0], protocol.FROM_PRODUCER)
        try:
            self._handle(router, routing_id, header, frames, user_id)
        except ProtocolError:
            raise
        except Exception:  # noqa: BLE001 - one peer's message must not stop the intake
            self._failed(router, routing_id, header)

    def _failed(self, router: zmq.Socket, routing_id: bytes, header: dict) -> None:
        """The handling of ``header`` raised: logged, booked as ``internal``, and told: a batch
        ``dropped`` (``_on_batch`` returned its credit), any other message ``refused``."""
        self.log_internal()
        conn = self.conns.get(routing_id)
        kind = header["t"]
        if kind in ("batch", "shm_batch") and conn is not None:
            self._refuse_batch(router, conn, header["seq"], DropReason.INTERNAL,
                               "unexpected error")  # fmt: skip
        else:
            detail = f"the trainer failed while handling this {kind} (a defect, in its log)"
            self._ledger.drop(DropReason.INTERNAL, detail, conn.index if conn else None)
            self.reply(router, routing_id, "refused", reason=DropReason.INTERNAL.value,
                       detail=detail)  # fmt: skip

    def _handle(
        self, router: zmq.Socket, routing_id: bytes, header: dict, frames: list[zmq.Frame],
        user_id: str | None,
    ) -> None:  # fmt: skip
        kind = header["t"]
        if kind == "hello":
            self._on_hello(router, routing_id, header, user_id)
            return
        conn = self.conns.get(routing_id)
        if conn is None:
            detail = "this connection has not said hello (trainer restarted?)"
            if kind == "batch":  # the producer can count exactly what was lost
                self.reply(router, routing_id, "dropped", seq=header["seq"],
                            reason=DropReason.NO_HELLO.value, detail=detail)  # fmt: skip
            self.reply(
                router, routing_id, "refused", reason=DropReason.NO_HELLO.value, detail=detail
            )
            raise ProtocolError(DropReason.NO_HELLO, f"{kind} before hello")
        self.conns.seen(conn)
        if kind == "batch":
            self._on_batch(router, conn, header, lambda: protocol.decode_batch(header, frames))
        elif kind == "shm_batch":
            self._on_batch(router, conn, header, lambda: self._shm_batch(conn, header))
        elif kind == "end":  # the producer's bye, and why (protocol.end_reason)
            self._ledger.ended(conn.index, header["seq"], *protocol.end_reason(header),
                               bad=protocol.end_bad(header))  # fmt: skip
            if self.shards.end(conn, header["seq"]) and conn.confirm:
                self._unconfirmed[conn.routing_id] = (conn.claim[0], header["seq"])
                self._saves_seen = -1  # look now: the checkpoint may hold it already
            self.conns.end(conn)
            if self.shm is not None:
                self.shm.ended(conn.routing_id)
            # Only a producer that delivered can end the data: a peer that said hello and
            # end at once must not stop a trainer that no producer has reached yet.
            if self._ledger.delivered(conn.index):
                self._delivered_and_ended = True
            if conn.ack_end:  # it may close now: everything it sent before ``end`` was read
                self.reply(router, routing_id, "ended", seq=header["seq"])
        elif kind == "end_pass":
            self.shards.end_pass(conn, header)
        elif kind == "leaving":
            self._told_saved.discard(routing_id)

    def _on_hello(
        self, router: zmq.Socket, routing_id: bytes, header: dict, user_id: str | None
    ) -> None:
        name = protocol.check_producer_name(header["name"])
        session = protocol.check_session(header)
        declared = protocol.schema_of_hello(header)
        if declared is not None and declared != self.schema:
            detail = schema_difference(self.schema, declared)
            self._ledger.refused(name, DropReason.SPEC_MISMATCH.value, detail)
            self.reply(
                router, routing_id, "refused", reason=DropReason.SPEC_MISMATCH.value, detail=detail
            )
            return
        conn = self.conns.get(routing_id)
        admitted = self.shards.hello(router, routing_id, name, session, header, conn)
        if admitted is None:
            return
        shard, passing = admitted
        position: dict[str, Any] = {}
        if conn is None:
            index = None if self.conns.full() else self._ledger.open(
                name if user_id is None else f"{name} {key_fingerprint(user_id)}", session,
                shard,
            )  # fmt: skip
            if index is None:
                detail = f"the trainer serves {MAX_LIVE_CONNECTIONS} connections at most"
                self._ledger.refused(name, DropReason.PEER_LIMIT.value, detail)
                self.reply(
                router, routing_id, "refused", reason=DropReason.PEER_LIMIT.value, detail=detail
            )
                return
            conn = self.conns.add(routing_id, index, name)
        self.conns.seen(conn)
        conn.ack_end = header.get("ack_end") is True
        if shard is not None or passing is not None:
            self.shards.bind(conn, header, session)
        self.shards.met(header)
        if isinstance(passing, int):
            conn.shard = passing
            epoch = self.passes.epoch
            position["pass"] = epoch
            position["pass_start"] = self.passes.start_of(passing, epoch)
            position["pass_count"] = max(self.passes.pass_count, epoch)
        granting = self._granting.is_set()
        grants = dict((c.routing_id, n) for c, n in self.conns.grants()) if granting else {}
        credit = grants.pop(routing_id, 0)
        wants_shm = self.shm is not None and header.get("shm") is True
        shm = self.shm.offer(routing_id, conn.index) if wants_shm else {}
        books = self._ledger.shards
        if books is not None and isinstance(shard, int):
            start, skip = books.welcome(shard)
            position.update(start=start, skip=skip)
            conn.confirm = books.confirms and header.get("confirm") is True
            if conn.confirm:
                position["confirm"] = True
        self.reply(
            router, routing_id, "welcome", schema=self.schema.to_dict(),
            max_message=self.options.max_message_bytes, credit=credit, **shm, **position,
        )  # fmt: skip
        for rid, n in grants.items():
            self.reply(router, rid, "credit", n=n)

    def send_passes(self, router: zmq.Socket) -> None:
        """Once every shard ended the pass and all of it left the intake: the next pass, and
        ``next_pass`` to every passing connection (it zeroes the producer's credit: what it
        holds returns to the pool, and grants follow)."""
        if self.conns.available != self.credit_pool or not self.passes.complete():
            return
        epoch = self.passes.advance(self._enqueued())
        log.info("every shard ended pass %d%s", epoch - 1,
                 f": pass {epoch} starts" if epoch < self.passes.pass_count else "")  # fmt: skip
        for conn in self.conns.live():
            if conn.shard is not None and not conn.ended:
                self.conns.pause(conn)
                conn.paused = False
                self.reply(router, conn.routing_id, "next_pass", **{"pass": epoch})

    def send_saved(self, router: zmq.Socket) -> None:
        """``saved`` to each ended producer whose whole shard a complete checkpoint holds
        (looked at after a new checkpoint or a new ``end``); a connection gone is forgotten."""
        books = self._ledger.shards
        if books is None or not self._unconfirmed or books.saves == self._saves_seen:
            return
        self._saves_seen = books.saves
        for routing_id, (shard, end) in list(self._unconfirmed.items()):
            conn = self.conns.get(routing_id)
            if conn is not None and books.saved_end(shard) != end:
                continue
            del self._unconfirmed[routing_id]
            if conn is not None:
                log.info("producer %s: shard %d is saved whole (%d batches): it may leave",
                         conn.name, shard, end)  # fmt: skip
                self.reply(router, routing_id, "saved", seq=end)
                self._told_saved.add(routing_id)

    def send_bye(self, router: zmq.Socket, conn: Connection) -> None:
        """``bye`` (the intake is closing); with ``finished`` to a producer that may be waiting
        for ``saved`` when the run is done: no trainer will resume it, so it may leave."""
        books = self._ledger.shards
        if conn.confirm and books is not None and books.finished:
            self.reply(router, conn.routing_id, "bye", finished=True)
            self._told_saved.add(conn.routing_id)
        else:
            self.reply(router, conn.routing_id, "bye")

    def awaiting_leaving(self) -> bool:
        """A live connection was let go (``saved``, or a finished run's ``bye``) and has not
        said ``leaving`` yet: a trainer closing waits a moment, or the message could be lost
        with the connection."""
        self._told_saved = {rid for rid in self._told_saved if self.conns.get(rid) is not None}
        return bool(self._told_saved)

    def _on_batch(
        self, router: zmq.Socket, conn, header: dict, decode: Callable[[], protocol.Batch]
    ) -> None:
        seq = header["seq"]
        if not self.conns.use_credit(conn):
            self._refuse_batch(router, conn, seq, DropReason.NO_CREDIT, "sent without credit")
            return
        # From here the batch holds a credit: however its checks fail, the credit returns
        # and the producer gets a verdict.
        try:
            self._admit_batch(router, conn, header, decode)
        except ProtocolError as exc:
            self.conns.finished(conn.routing_id)
            self._refuse_batch(router, conn, seq, exc.reason, exc.detail)
        except Exception:  # noqa: BLE001 - a defect: logged, and the batch still answered
            self.conns.finished(conn.routing_id)
            raise  # handle() books it as internal and says ``dropped``

    def _admit_batch(
        self, router: zmq.Socket, conn, header: dict, decode: Callable[[], protocol.Batch]
    ) -> None:
        """A batch holding a credit: checked, then handed to the enqueue threads, or dropped
        (its credit returned, the producer told). ``ProtocolError``: a failed check."""
        seq = header["seq"]
        batch = decode()
        protocol.check_against_schema(batch, self.schema)
        if conn.claim is not None and seq >= MAX_SEQ:
            raise ProtocolError(DropReason.SEQ_RANGE, f"seq {seq} of shard {conn.claim[0]}: an "
                                f"input position holds seqs below 2**53")  # fmt: skip
        why = self.shards.settle(conn)
        if why is not None:  # its hello's shard count is not the run's, settled since
            self.conns.finished(conn.routing_id)
            self._refuse_batch(router, conn, seq, DropReason.SHARD, why)
            self.reply(router, conn.routing_id, "refused", reason=DropReason.SHARD.value,
                       detail=why)  # fmt: skip
            self._forget(conn)
            return
        reason = self._ledger.accept(conn.index, seq, batch.nbytes)
        if reason is not None:
            self.conns.finished(conn.routing_id)
            self.reply(router, conn.routing_id, "dropped", seq=seq, reason=reason.value,
                        detail=f"seq {seq}")  # fmt: skip
            return
        if header["t"] == "shm_batch":
            self.shm.batches += 1
        self._handoff.put_nowait((conn.routing_id, conn.index, seq, batch.arrays))

    def _shm_batch(self, conn, header: dict) -> protocol.Batch:
        if self.shm is None:
            raise ProtocolError(DropReason.SHM_POOL, "this trainer maps no pools (--transport zmq)")
        return self.shm.batch(conn.routing_id, header)

    def send_releases(self, router: zmq.Socket) -> None:
        """Slots TensorFlow let go of, back to their producers (the finalizers queued them)."""
        if self.shm is None:
            return
        for routing_id, pool, slot, gen in self.shm.releases():
            self.reply(router, routing_id, "release", pool=pool, slot=slot, gen=gen)

    def _refuse_batch(self, router, conn, seq: int, reason: DropReason, detail: str) -> None:
        self._ledger.drop(reason, f"producer {conn.name}: {detail}", conn.index)
        self.reply(
            router, conn.routing_id, "dropped", seq=seq, reason=reason.value, detail=detail
        )

    def data_ended(self) -> bool:
        """True once a producer that delivered (a valid batch booked on its connection, or on
        an earlier connection of its run) said ``end``, every live connection has said
        ``end``, every shard of their ``produce`` commands said hello (``Shards.unmet``;
        with books, ``ShardBooks.missing``), and every batch received has left the intake
        (enqueued or dropped). An
        ``end`` from a connection that delivered nothing ends nothing: a run that has
        received no batch never ends for lack of data (docs/guarantees.md).
        """
        return self._data_ended.is_set()

    def update_data_ended(self) -> None:
        live = self.conns.live()
        ended = (
            self._delivered_and_ended
            and all(c.ended for c in live)
            and self.conns.available == self.credit_pool
        )
        books = self._ledger.shards
        if ended and books is not None and (missing := books.missing()):
            ended = False  # a shard's stream is not all here: its producer rewinds, or is gone
            if self._internal_log.due("shards-missing"):
                log.warning("every producer said end, but shards %s are not complete (first "
                            "batch missing: %s): waiting for their producers (restart them if "
                            "they are gone)", sorted(missing), missing)  # fmt: skip
        if ended and books is None and (unmet := self.shards.unmet()):
            ended = False  # a sibling of a producer that ended has not connected yet
            if self._internal_log.due("siblings-unmet"):
                log.warning("every producer said end, but shards %s of their produce commands "
                            "never connected: waiting for them", unmet)  # fmt: skip
        if ended:
            self._data_ended.set()
        else:
            self._data_ended.clear()

    def expire(self, router: zmq.Socket) -> None:
        for conn in self.conns.revoke_hoarded():
            log.info("producer %s held credit unused for %.0f s while others waited: revoked",
                     conn.name, self.conns.timeout_s)  # fmt: skip
            self.reply(router, conn.routing_id, "refused", reason=DropReason.NO_HELLO.value,
                        detail="credit unused while others waited: say hello again")  # fmt: skip
            self._ledger.forget_if_idle(conn.index)
        for conn in self.conns.expire():
            if self._forget(conn, removed=True):
                log.debug("connection %s went away without delivering", conn.name)
            elif not conn.ended:
                log.info("producer %s silent for %.0f s: forgotten", conn.name,
                         self.conns.timeout_s)  # fmt: skip

    def _forget(self, conn: Connection, removed: bool = False) -> bool:
        """Forget a connection gone (its credit returns); True if its books went too (it
        delivered nothing)."""
        if not removed:
            self.conns.remove(conn)
        if self.shm is not None:
            self.shm.forget(conn.routing_id)
        return self._ledger.forget_if_idle(conn.index)

    def stop_granting(self) -> None:
        """Grant no more credit (before the queue closes): at most the credit pool is then
        received and not enqueued at stop.
        """
        self._granting.clear()

    def send_grants(self, router: zmq.Socket) -> None:
        if not self._granting.is_set():
            return
        for conn, n in self.conns.grants():
            self.reply(router, conn.routing_id, "credit", n=n)

    reply = staticmethod(reply)
