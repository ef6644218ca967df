"""Producer connections as the trainer's intake knows them, and the credit that paces them.

Flow control is credit-based (the ZeroMQ guide's file-transfer pattern): a producer sends a
batch only against a credit the trainer granted. The trainer holds a fixed pool of credits,
so the bytes in flight towards it are ``pool x batch_bytes`` however many producers connect.

Invariants (the intake thread is the only caller; nothing here is thread-safe):
  - ``available + sum(c.outstanding + c.in_hand for c in live) == pool``: a credit is free,
    granted and not yet used (``outstanding``), or used by a batch the trainer still handles
    (``in_hand``); ``finished`` returns it to the pool.
  - no connection holds more than ``per_peer`` credits (outstanding + in hand), and grants go
    to the connections holding least first, so a fast producer cannot starve the others.
  - a connection silent for ``timeout_s`` is forgotten and its outstanding credit returns;
    credit in hand returns when those batches finish, even after the connection is gone.
  - credit is a lease: a connection that holds credit unused for ``timeout_s`` while another
    starves is forgotten too (``revoke_hoarded``), so idle peers cannot hoard the pool.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagefeed.common.data_order import DataOrder


@dataclasses.dataclass
class Connection:
    """One producer connection, keyed by the routing id ZeroMQ gave it (unforgeable)."""

    routing_id: bytes
    index: int  # its entry in the ledger, and the ``peer`` component in the TF queue
    name: str
    last_seen: float
    last_used: float = 0.0  # when it last used credit (or first got some)
    outstanding: int = 0
    in_hand: int = 0
    ended: bool = False
    paused: bool = False  # ended a pass, waits for the next (consumer/intake/passes.py)
    shard: int | None = None  # the shard of a passing producer
    # (shard, shards, seekable) its hello named, admitted: it owns that shard while it lives
    # (consumer/intake/claims.py); None: it names no shard, or none is booked
    claim: tuple[int, int, bool] | None = None
    group: range | None = None  # the shards of its ``produce`` command (its hello's group)
    order: DataOrder | None = None  # the data's order its hello named (common/data_order.py)
    session: str | None = None  # its producer run's secret token (consumer/books/ledger.py)
    confirm: bool = False  # welcomed with ``confirm``: told ``saved`` once its shard is saved
    ack_end: bool = False  # its hello said ``ack_end``: told ``ended`` once its ``end`` is read


class Connections:
    """The live connections and the credit pool."""

    def __init__(self, pool: int, per_peer: int, max_live: int, timeout_s: float) -> None:
        if pool < 1 or per_peer < 1:
            raise ValueError("credit pool and per-peer credit must be >= 1")
        self.pool = pool
        self.per_peer = per_peer
        self.max_live = max_live
        self.timeout_s = timeout_s
        self.available = pool
        self._live: collections.OrderedDict[bytes, Connection] = collections.OrderedDict()
        # Credit in hand of connections already gone, returned when their batches finish.
        self._orphaned: collections.Counter[bytes] = collections.Counter()

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> list[Connection]:
        return list(self._live.values())

    def get(self, routing_id: bytes) -> Connection | None:
        return self._live.get(routing_id)

    def full(self) -> bool:
        return len(self._live) >= self.max_live

    def add(self, routing_id: bytes, index: int, name: str) -> Connection:
        """A connection that said hello; a second hello on it keeps its books and credit."""
        conn = self._live.get(routing_id)
        if conn is None:
            conn = Connection(routing_id, index, name, time.monotonic())
            self._live[routing_id] = conn
        return conn

    def seen(self, conn: Connection) -> None:
        conn.last_seen = time.monotonic()

    def use_credit(self, conn: Connection) -> bool:
        """A batch arrived on ``conn``: False if it had no credit (flow control ignored)."""
        if conn.outstanding <= 0:
            return False
        conn.last_used = time.monotonic()
        conn.outstanding -= 1
        conn.in_hand += 1
        return True

    def finished(self, routing_id: bytes) -> None:
        """The trainer is done with one batch of that connection (enqueued or dropped)."""
        conn = self._live.get(routing_id)
        if conn is not None and conn.in_hand > 0:
            conn.in_hand -= 1
            self.available += 1
        elif self._orphaned[routing_id] > 0:
            self._orphaned[routing_id] -= 1
            if not self._orphaned[routing_id]:
                del self._orphaned[routing_id]
            self.available += 1

    def grants(self) -> list[tuple[Connection, int]]:
        """Hand out free credit one at a time, least-holding connection first; (connection, n)."""
        granted: collections.Counter[bytes] = collections.Counter()
        while self.available > 0:
            wanting = sorted(
                (c for c in self._live.values()
                 if not (c.ended or c.paused) and c.outstanding + c.in_hand < self.per_peer),
                key=lambda c: c.outstanding + c.in_hand,
            )  # fmt: skip
            if not wanting:
                break
            for conn in wanting:
                if self.available == 0:
                    break
                if conn.outstanding + conn.in_hand == 0:
                    conn.last_used = time.monotonic()  # its lease starts now
                conn.outstanding += 1
                self.available -= 1
                granted[conn.routing_id] += 1
        return [(self._live[rid], n) for rid, n in granted.items()]

    def expire(self) -> list[Connection]:
        """Forget connections silent for ``timeout_s``; their outstanding credit returns."""
        now = time.monotonic()
        gone = [c for c in self._live.values() if now - c.last_seen > self.timeout_s]
        for conn in gone:
            self.remove(conn)
        return gone

    def revoke_hoarded(self) -> list[Connection]:
        """Forget connections that held credit unused for ``timeout_s`` while another one
        starves (holds none and wants some): pinging keeps a connection alive, not its credit.
        Its credit returns to the pool; the producer is told to say hello again.
        """
        starving = any(
            not (c.ended or c.paused) and c.outstanding + c.in_hand == 0
            for c in self._live.values()
        )
        if not starving or self.available > 0:
            return []
        now = time.monotonic()
        hoarders = [
            c for c in self._live.values()
            if c.outstanding > 0 and now - c.last_used > self.timeout_s
        ]  # fmt: skip
        for conn in hoarders:
            self.remove(conn)
        return hoarders

    def remove(self, conn: Connection) -> None:
        del self._live[conn.routing_id]
        self.available += conn.outstanding
        conn.outstanding = 0
        if conn.in_hand:
            self._orphaned[conn.routing_id] += conn.in_hand

    def end(self, conn: Connection) -> None:
        """The producer's data ended: it needs no more credit."""
        conn.ended = True
        self.pause(conn)

    def pause(self, conn: Connection) -> None:
        """The producer needs no credit for now (it ended a pass): its unused credit returns;
        ``paused`` is cleared when the next pass starts (and ``next_pass`` zeroes its credit)."""
        conn.paused = True
        self.available += conn.outstanding
        conn.outstanding = 0
