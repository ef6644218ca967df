"""Who may speak for a shard: one live connection at a time, and only of what it carried.

A shard's identity is an input like any other (docs/guarantees.md): a producer that names a
shard is checked, never trusted blindly, and two ``produce`` commands started with the same
shards by mistake meet the same rules as a hostile peer.

- Ownership: the first connection admitted for a shard owns it while it lives. Another hello
  naming that shard is refused (``shard_taken``, naming the owner; the producer says hello
  again a moment later, ``producer.session``), unless the owner is known gone: forgotten
  (silent for ``--producer-timeout-s``), its connection closed (ZeroMQ no longer routes to it:
  ``routable``, a probe sent at the claim), or it is an earlier connection of the same
  producer run (the same secret session token). The newcomer then takes over from the
  position (its welcome), and the old connection is forgotten.
- Ends: an ``end`` or ``end_pass`` counts for a shard only from its owner and only at the
  shard's reach, one past the batches it carried (``reach_of``); otherwise it is dropped as
  ``shard_end`` (counted, logged throttled) and books nothing about the shard.

- The count: a hello settles no shard count; the first batch does (``settle``: the
  ``ShardBooks`` and ``PassBooks`` of consumer/books/shard_books.py and
  consumer/intake/passes.py). A batch of a connection whose hello named another count is
  dropped (``shard``) and the producer refused. The data's order (``common.data_order``)
  likewise: a hello of another order than the run's is refused (``shard``).
- Elastic resume: a hello naming another count than the resumed checkpoint's, with the
  checkpoint's order, before any batch, has the position dealt out to its count
  (``ShardBooks.redeal``; ``PassBooks.redealt`` starts the passes from it).

``Shards`` applies these rules for ``consumer.intake.dispatch``. The intake thread is the only
caller; nothing here is thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from stagefeed.common import protocol
from stagefeed.common.data_order import order_of_hello
from stagefeed.common.errors import ConfigError, DropReason, ProtocolError
from stagefeed.common.position import InputPosition
from stagefeed.common.throttle import LogThrottle
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.connections import Connection, Connections
from stagefeed.consumer.intake.frames import reply
from stagefeed.consumer.intake.passes import PassBooks

log = logging.getLogger(__name__)


class Shards:
    """The intake's rules for shards: hellos, batches and ends (see the module docstring)."""

    def __init__(
        self,
        ledger: Ledger,
        passes: PassBooks,
        conns: Connections,
        no_passes: str,
        forget: Callable[[Connection], object],
        batch_size: int,
    ) -> None:
        self._ledger = ledger
        self._batch_size = batch_size  # the schema's: an order's batches are of this size
        self.passes = passes
        self._conns = conns
        self._no_passes = no_passes  # why a passing hello is refused here ("": it is not)
        self._forget = forget  # forgets a connection gone (its credit and books)
        self._log = LogThrottle()
        self._owners: dict[int, bytes] = {}
        # Without books (no ``--save``): the shards whose producer was welcomed, and the other
        # shards of their ``produce`` commands. A sibling process may start late (a loaded
        # host): until it says hello, the data has not ended (``unmet``).
        self._met: set[int] = set()
        self._siblings: set[int] = set()

    def hello(
        self, router: zmq.Socket, routing_id: bytes, name: str, session: str | None,
        header: dict, conn: Connection | None,
    ) -> tuple[int | None, int | None] | None:  # fmt: skip
        """``(booked, passing)``: the shard a hello names for the input position and as a
        passing producer (None: not); None if the hello is refused (sent and booked)."""
        named = protocol.shard_of_hello(header)
        shard = self._shard(router, routing_id, name, named, header)
        passing = shard is not False and self._passing(router, routing_id, name, header, named)
        if shard is False or passing is False:
            return None
        claimed = shard if isinstance(shard, int) else passing
        if claimed is not None and not self._claim(router, routing_id, name, session, claimed,
                                                   conn):  # fmt: skip
            return None
        return shard, passing

    def bind(self, conn: Connection, header: dict, session: str | None) -> None:
        """``conn`` was welcomed carrying the shard its hello named (``hello`` admitted it)."""
        named = protocol.shard_of_hello(header)
        if named is not None:
            conn.claim, conn.session = named, session
            conn.group = protocol.group_of_hello(header)
            conn.order = order_of_hello(header, self._batch_size)  # checked by ``hello``
            self._owners[named[0]] = conn.routing_id

    def met(self, header: dict) -> None:
        """A welcomed hello: without books, note its shard and its ``produce`` command's (a
        group that does not hold its shard is ignored; with books, ``hello`` refuses it and
        ``ShardBooks.missing`` waits for the group)."""
        named = protocol.shard_of_hello(header)
        if self._ledger.shards is not None or named is None:
            return
        shard, shards, _ = named
        self._met.add(shard)
        if _group_problem(shard, shards, header) is None:
            self._siblings.update(protocol.group_of_hello(header) or ())

    def unmet(self) -> list[int]:
        """Shards of a welcomed producer's ``produce`` command that never said hello here."""
        return sorted(self._siblings - self._met)

    def owns(self, conn: Connection, shard: int) -> bool:
        return self._owners.get(shard) == conn.routing_id

    def end(self, conn: Connection, end: int) -> bool:
        """Book where ``conn``'s shard ends: only its owner's ``end``, at the shard's reach
        (``ShardBooks.ended``), else dropped as ``shard_end``; True if booked."""
        books = self._ledger.shards
        if books is None or conn.claim is None:
            return False
        shard, shards, _ = conn.claim
        why = (
            books.ended(shard, shards, end) if self.owns(conn, shard)
            else f"another connection carries shard {shard} now"
        )  # fmt: skip
        if why is not None:
            self._ledger.drop(DropReason.SHARD_END,
                              f"producer {conn.name}: end of shard {shard} ignored: {why}",
                              conn.index)  # fmt: skip
        return why is None

    def _shard(
        self, router: zmq.Socket, routing_id: bytes, name: str, named: Any, header: dict
    ) -> Any:
        """The shard a hello names (``named``: ``protocol.shard_of_hello``), admitted (None: it
        names none, or this trainer books no positions); False if it was refused (the refusal
        is sent and booked)."""
        books = self._ledger.shards
        if books is None:
            return None
        if named is None:
            if self._log.due("no-shard"):
                log.warning("producer %s names no shard: its batches are in no input position "
                            "(a resumed run may train them again)", name)  # fmt: skip
            return None
        shard, shards, _ = named
        try:
            order = order_of_hello(header, self._batch_size)
        except ConfigError as exc:
            why: str | None = str(exc)
        else:
            redealt = books.redeal(shards, order)
            if isinstance(redealt, InputPosition):
                self.passes.redealt(redealt)
            why = redealt if isinstance(redealt, str) else None
            why = why or books.join(shard, shards, order) or _group_problem(shard, shards, header)
        if why is None:
            return shard
        self._ledger.refused(name, DropReason.SHARD.value, why)
        reply(router, routing_id, "refused", reason=DropReason.SHARD.value, detail=why)
        return False

    def _passing(
        self, router: zmq.Socket, routing_id: bytes, name: str, header: dict, named: Any
    ) -> Any:
        """The shard of a hello that said ``passes`` (None: it did not); False if refused."""
        if header.get("passes") is not True:
            return None
        why = "a producer with passes must name its shard" if named is None else None
        why = why or self._no_passes or self.passes.join(named[0], named[1])
        if why is None:
            return named[0]
        self._ledger.refused(name, DropReason.SHARD.value, why)
        reply(router, routing_id, "refused", reason=DropReason.SHARD.value, detail=why)
        return False

    def _claim(self, router: zmq.Socket, routing_id: bytes, name: str, session: str | None,
               shard: int, conn: Connection | None) -> bool:  # fmt: skip
        """Whether a hello may carry ``shard``: refused (``shard_taken``, one line naming both)
        while another live connection owns it; an owner known gone is forgotten and the new
        connection takes over from the position (see the module docstring)."""
        if conn is not None and conn.claim is not None and conn.claim[0] != shard:
            why = f"this connection carries shard {conn.claim[0]}, not {shard}"
            self._refuse_hello(router, routing_id, name, DropReason.SHARD, why)
            return False
        held, gone = self._holder(router, shard, routing_id, session)
        if gone is not None:
            log.info("producer %s takes over shard %d from %s (that connection is gone)",
                     name, shard, gone.name)  # fmt: skip
            self._forget(gone)
        if held is None:
            return True
        why = (f"shard {shard} is carried by the live connection of producer {held.name}: one "
               f"connection carries a shard at a time (two produce commands with the same "
               f"shards? give each its own --shard-group); say hello again once it is gone")
        self._refuse_hello(router, routing_id, name, DropReason.SHARD_TAKEN, why)
        return False

    def _refuse_hello(self, router, routing_id: bytes, name: str, reason: DropReason,
                      why: str) -> None:  # fmt: skip
        self._ledger.refused(name, reason.value, why)
        reply(router, routing_id, "refused", reason=reason.value, detail=why)

    def end_pass(self, conn: Connection, header: dict) -> None:
        """Book where the producer's pass ended (only its shard's owner, at the shard's reach:
        else dropped as ``shard_end``); its credit returns until the next pass."""
        if conn.shard is None or conn.claim is None:
            raise ProtocolError(DropReason.HEADER_FIELDS, "end_pass from a hello without passes")
        seq, pass_ = header["seq"], header["pass"]
        refused = self._pass_end_refused(conn, conn.claim, seq)
        if refused is not None:
            self._ledger.drop(DropReason.SHARD_END,
                              f"producer {conn.name}: end of pass {pass_} ignored: {refused}",
                              conn.index)  # fmt: skip
            return
        self._conns.pause(conn)
        why = self.passes.ended(conn.shard, pass_, seq)
        if why is not None and self._log.due("end-pass"):
            log.warning("producer %s: %s (ignored)", conn.name, why)
        books = self._ledger.shards
        if books is not None:
            books.pass_ends(conn.shard, self.passes.ends.get(conn.shard, []))
        if self._log.due(f"end-pass:{conn.shard}"):  # a peer can say it at will
            missing = self.passes.missing()
            log.info("producer %s (shard %d) ended pass %d at batch %d%s", conn.name,
                     conn.shard, pass_, seq,
                     f"; waiting for shards {missing}" if missing else "")  # fmt: skip

    def _pass_end_refused(self, conn: Connection, claim: tuple, seq: int) -> str | None:
        """Why ``conn``'s pass cannot end at ``seq``: not its shard's owner, another shard
        count, or not the shard's reach (with ``--save``: ``ShardBooks.pass_ended``; else one
        past the producer run's last batch, or the pass's start if it sent none)."""
        shard, shards, _ = claim
        if not self.owns(conn, shard):
            return f"another connection carries shard {shard} now"
        books = self._ledger.shards
        if books is not None:
            return books.pass_ended(shard, shards, seq)
        if self.passes.shards != shards:
            return f"the passes' shard count is {self.passes.shards or 'not settled'}, not {shards}"
        low = self._ledger.reached(conn.index)
        high = max(low, self.passes.start_of(shard, self.passes.epoch))
        if not low <= seq <= high:
            return f"a pass ends at {seq}, but shard {shard}'s batches reach {low}"
        return None

    def settle(self, conn: Connection) -> str | None:
        """A valid batch of ``conn``: its shard count is settled by the first (``ShardBooks``,
        ``PassBooks``); why the batch is refused if another count was settled before."""
        if conn.claim is None:
            return None
        shard, shards, seek = conn.claim
        books = self._ledger.shards
        why = (
            books.settle(shard, shards, seek, conn.group, conn.order) if books is not None
            else None
        )  # fmt: skip
        if why is None and conn.shard is not None:
            why = self.passes.settle(shard, shards)
        return why

    def _holder(
        self, router: zmq.Socket, shard: int, routing_id: bytes, session: str | None
    ) -> tuple[Connection | None, Connection | None]:
        """``(held_by, gone)`` for a hello of ``routing_id`` naming ``shard``: the live owner
        that keeps it (the claim is refused), or the owner known gone, which the caller
        forgets before the claim takes over (both None: the shard is free)."""
        owner_id = self._owners.get(shard)
        owner = self._conns.get(owner_id) if owner_id not in (None, routing_id) else None
        if owner is None:
            return None, None
        if session is not None and owner.session == session:
            return None, owner  # this producer's earlier connection: it reconnected
        if not routable(router, owner.routing_id):
            return None, owner
        return owner, None


def routable(router: zmq.Socket, routing_id: bytes) -> bool:
    """Whether ``router`` still has a connection to ``routing_id``: a ``credit {n: 0}`` (a
    no-op to a producer) sent with ``ROUTER_MANDATORY``, which fails with ``EHOSTUNREACH`` once
    libzmq has closed that peer's pipe (the peer closed, was killed, or missed its heartbeats:
    common/liveness.py)."""
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        router.send_multipart(
            [routing_id, protocol.encode_control("credit", n=0)], flags=zmq.NOBLOCK
        )
    except zmq.Again:
        return True  # there, with its queue full
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    finally:
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
    return True


def _group_problem(shard: int, shards: int, header: dict) -> str | None:
    """Why a hello's group (``group_first``, ...) does not hold its shard within ``shards``."""
    group = protocol.group_of_hello(header)
    if group is None or (shard in group and group[-1] < shards):
        return None
    every = f", every {group.step}" if group.step > 1 else ""
    return f"shard {shard} of {shards} is not in its group {group.start}..{group[-1]}{every}"
