"""The trainer's books: every batch received is trained, still queued at stop, or dropped.

Books belong to a *connection*, not to a name a message claims: the intake opens an entry when
a connection says hello and hands batches in under that entry's index, so no header can write
into another connection's books. The producer's self-declared name (and its CURVE key, when
keys are used) only labels the entry: any peer can claim any name, so a name never merges,
links or renames anything. An entry's key (summary, metrics) is fixed when it opens: its label,
or ``label#index`` if an open entry holds that key already.

Connections of one producer run are linked only by the secret ``session`` token of their
hellos (a producer draws it once; it is never echoed, logged or exported): the hole between
them is that producer's ``seq_missing``, and an ``end`` on a new connection counts as the end
of a producer that delivered.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable

from stagefeed.common.errors import DropReason
from stagefeed.common.options import MIB
from stagefeed.common.throttle import LogThrottle
from stagefeed.consumer.books.books import LedgerSnapshot, ProducerTotals, Totals
from stagefeed.consumer.books.sequence import SequenceTracker
from stagefeed.consumer.books.shard_books import ShardBooks

log = logging.getLogger(__name__)
__all__ = ["Ledger", "LedgerSnapshot", "ProducerStats", "ProducerTotals", "Totals"]

# Drops from connections without books (no hello, or a malformed message before one).
UNIDENTIFIED = "<unidentified>"
# Entries kept at most; a connection that said hello and delivered nothing is forgotten when it
# goes away, so hello floods cannot fill the books.
MAX_ENTRIES = 1024
MAX_REFUSED_NAMES = 256
# A sequence number more than this far past a connection's highest, or below its first, is
# refused and does not move its window (one connection delivers in order; this is forged).
MAX_SEQ_AHEAD = 1 << 16
MAX_LEFT = 16  # producers that left for a reason other than ``ok``, kept for the summary
MAX_BAD_SHOWN = 3  # bad records named in the summary (the first each producer skipped)


@dataclasses.dataclass
class ProducerStats:
    """What one connection delivered. ``index`` is its small integer id inside the TF queue."""

    label: str
    index: int
    first_seen: float
    key: str = ""  # in the summary and the metrics: fixed at open, unique among open entries
    session: str | None = None  # the producer run's secret token: links its connections
    shard: int | None = None  # the stream it says it carries (resume; consumer.books.shard_books)
    last_seen: float = 0.0  # its last valid batch
    first_batch_at: float | None = None  # its first valid batch
    received: int = 0
    received_bytes: int = 0
    enqueued: int = 0
    trained: int = 0
    abandoned: int = 0  # dequeued by a dataset iterator that was dropped before training them
    ended_after: int | None = None  # the producer's ``end``: batches it sent on this connection
    end_reason: str | None = None  # why its first ``end`` said it left (``protocol.END_*``)
    end_detail: str = ""  # the error it left with: one sanitised line
    sequence: SequenceTracker = dataclasses.field(default_factory=SequenceTracker)
    trained_sequence: SequenceTracker = dataclasses.field(default_factory=SequenceTracker)
    drops: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    # The two derived figures, defined here only: the totals are their sums.
    @property
    def queued(self) -> int:
        """Enqueued and neither trained nor abandoned: in the queue, staging or prefetch."""
        return self.enqueued - self.trained - self.abandoned

    @property
    def not_enqueued(self) -> int:
        """Received and not (yet) in the queue: in the intake's hands."""
        return self.received - self.enqueued


class Ledger:
    """Thread-safe accounting shared by the intake, the enqueue threads and the train loop.

    Invariant, per entry, at any quiescent moment::

        received == enqueued + in_hand + not_enqueued_at_stop   and
        enqueued == trained + abandoned + queued (FIFOQueue + staging / prefetch)

    Drops are counted apart (by reason), under the entry when the connection has one.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, shards: ShardBooks | None = None) -> None:
        self._lock = threading.Lock()
        # Per-shard positions, with ``--save`` (resume): None books no position.
        self.shards = shards
        self._max_entries = max_entries
        self._entries: dict[int, ProducerStats] = {}
        self._next_index = 0
        self._unidentified: collections.Counter[str] = collections.Counter()
        self._refused: dict[str, collections.Counter[str]] = {}
        self._log_throttle = LogThrottle()  # a junk flood must not flood the log
        self._peer_events: collections.Counter[str] = collections.Counter()
        self._ended: collections.Counter[str] = collections.Counter()  # connections, by reason
        self._left: collections.deque[dict] = collections.deque(maxlen=MAX_LEFT)
        self._bad = 0  # records the producers' sources skipped, as their ``end``s said
        self._bad_shown: list[str] = []

    def open(
        self, label: str, session: str | None = None, shard: int | None = None
    ) -> int | None:
        """A new entry for a connection that said hello; None when the books are full.

        ``session``: the secret token of the producer run (None: linked to nothing);
        ``shard``: the stream it carries, admitted by ``shards.join`` (None: no position)."""
        with self._lock:
            if len(self._entries) >= self._max_entries:
                self._unidentified[DropReason.PEER_LIMIT.value] += 1
                return None
            index = self._next_index
            self._next_index += 1
            taken = {s.key for s in self._entries.values()}
            key = label
            while key in taken:  # a label may itself end in "#N"
                key += f"#{index}"
            self._entries[index] = ProducerStats(
                label, index, first_seen=time.monotonic(), key=key, session=session,
                shard=shard if self.shards is not None else None,
            )  # fmt: skip
        log.info("producer %s connected (index %d)", key, index)
        return index

    def shard_of(self, index: int) -> int | None:
        """The shard entry ``index`` carries (None: none, or no positions booked)."""
        with self._lock:
            stats = self._entries.get(index)
            return None if stats is None else stats.shard

    def name(self, index: int) -> str:
        """The books' name of entry ``index`` (its row in ``summary()``); KeyError if none."""
        with self._lock:
            return self._entries[index].key

    def forget_if_idle(self, index: int) -> bool:
        """Drop the entry of a connection that went away having delivered nothing."""
        with self._lock:
            stats = self._entries.get(index)
            if stats is None or stats.received or stats.drops:
                return False
            del self._entries[index]
            return True

    def accept(self, index: int, seq: int, nbytes: int) -> DropReason | None:
        """Book a valid batch of entry ``index``; the reason to drop it instead, if any."""
        now = time.monotonic()
        with self._lock:
            stats = self._entries[index]
            lowest, highest = stats.sequence.lowest, stats.sequence.highest
            # One connection delivers in order: nothing comes before its first number.
            shard = stats.shard
            if lowest is not None and (seq > highest + MAX_SEQ_AHEAD or seq < lowest):
                reason = DropReason.SEQ_RANGE
            elif shard is not None and (refused := self.shards.admit(shard, seq)) is not None:
                reason = refused  # trained before (resume), or in flight from elsewhere
            elif stats.sequence.record(seq):
                stats.received += 1
                stats.received_bytes += nbytes
                stats.last_seen = now
                if stats.first_batch_at is None:
                    stats.first_batch_at = now
                return None
            else:
                reason = DropReason.DUPLICATE
                if shard is not None:
                    self.shards.lost(shard, seq)  # admitted above: not in flight after all
            stats.drops[reason.value] += 1
        self._log_drop(reason, f"producer {stats.key} seq {seq}")
        return reason

    def drop(self, reason: DropReason, detail: str, index: int | None = None) -> None:
        """Book a refused message, under its connection's entry when it has one."""
        with self._lock:
            stats = self._entries.get(index) if index is not None else None
            if stats is not None:
                stats.drops[reason.value] += 1
            else:
                self._unidentified[reason.value] += 1
        self._log_drop(reason, detail)

    def refused(self, name: str, reason: str, detail: str) -> None:
        """Book a refused hello by the producer's declared name (bounded number of names)."""
        with self._lock:
            key = name if name in self._refused or len(self._refused) < MAX_REFUSED_NAMES else "*"
            self._refused.setdefault(key, collections.Counter())[reason] += 1
            total = sum(c[reason] for c in self._refused.values())
            if not self._log_throttle.due("refused:" + reason):
                return
        log.warning("refused producer %s (%s, %d so far): %s", name, reason, total, detail)

    def ended(
        self, index: int, count: int, reason: str = "ok", detail: str = "",
        bad: tuple[int, str] = (0, ""),
    ) -> None:  # fmt: skip
        """Book entry ``index``'s ``end`` (``count`` batches sent) and why it left: ``reason``
        (``protocol.END_*``) and ``detail`` (one sanitised line) of its first ``end``, counted
        once per connection, with the records its source skipped (``bad``: how many, the first
        named). Logged at each first ``end``; repeats throttled (no flood)."""
        with self._lock:
            stats = self._entries[index]
            stats.ended_after = count
            first = stats.end_reason is None
            if first:
                stats.end_reason, stats.end_detail = reason, detail
                self._ended[reason] += 1
                self._bad += bad[0]
                if bad[0] and len(self._bad_shown) < MAX_BAD_SHOWN:
                    self._bad_shown.append(f"{stats.key}: {bad[1]}")
                if reason != "ok":
                    self._left.append({"producer": stats.key, "reason": reason,
                                       "detail": detail, "ended_after": count})  # fmt: skip
            reason, detail = stats.end_reason, stats.end_detail
            if not (first or self._log_throttle.due("end:again")):
                return
        why, level = (
            (reason, logging.INFO) if reason == "ok" else (f"{reason}: {detail}", logging.WARNING)
        )
        log.log(level, "producer %s: end of data after %d batches (%s)", stats.key, count, why)

    def bad_records(self) -> tuple[int, tuple[str, ...]]:
        """Records the producers' sources skipped, and the first ones named (their ``end``s)."""
        with self._lock:
            return self._bad, tuple(self._bad_shown)

    def left(self) -> list[dict]:
        """The latest ``MAX_LEFT`` non-``ok`` ends, oldest first (kept past their entry)."""
        with self._lock:
            return list(self._left)

    def enqueued(self, index: int) -> None:
        with self._lock:
            self._entries[index].enqueued += 1

    def trained(self, indices: Iterable[int], seqs: Iterable[int]) -> None:
        """Book batches the train step consumed, identified by (entry index, seq)."""
        with self._lock:
            for index, seq in zip(indices, seqs, strict=True):
                stats = self._entries[int(index)]
                stats.trained += 1
                stats.trained_sequence.record(int(seq))
                if stats.shard is not None:
                    self.shards.trained(stats.shard, int(seq))

    def peer_event(self, name: str) -> None:
        """Book a connection event of the bound socket (named by ``intake.socket_events``)."""
        with self._lock:
            self._peer_events[name] += 1

    def peer_events(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peer_events)

    def producer_count(self) -> int:
        with self._lock:
            return len(self._entries)

    def delivered(self, index: int) -> bool:
        """Whether entry ``index``, or an earlier connection of its producer run (the same
        session token), booked a valid batch: only such a producer's ``end`` ends data."""
        with self._lock:
            stats = self._entries.get(index)
            if stats is None:
                return False
            run = [s.received for s in self._entries.values() if s.session == stats.session]
            return stats.received > 0 or (stats.session is not None and any(run))

    def reached(self, index: int) -> int:
        """One past the highest ``seq`` booked on entry ``index`` or an earlier connection of
        its producer run (the same session token); 0 if none: where its stream has reached."""
        with self._lock:
            stats = self._entries.get(index)
            if stats is None:
                return 0
            run = [s for s in self._entries.values()
                   if s is stats or (stats.session is not None and s.session == stats.session)]
            return max(s.sequence.highest for s in run) + 1

    def _gaps(self) -> dict[int, int]:
        """Sequence numbers lost between two connections of one producer run (a cut
        connection it carried on after): the hole before each later entry of the same session
        token. Never by name: a name can be claimed by anyone. Lock held.
        """
        gaps: dict[int, int] = {}
        last: dict[str, int] = {}
        for s in sorted(self._entries.values(), key=lambda s: s.index):
            if s.sequence.lowest is None or s.session is None:
                continue
            previous = last.get(s.session)
            if previous is not None and s.sequence.lowest > previous + 1:
                gaps[s.index] = s.sequence.lowest - previous - 1
            last[s.session] = max(s.sequence.highest, previous if previous is not None else -1)
        return gaps

    def abandoned(self, indices: Iterable[int], seqs: Iterable[int]) -> None:
        """Book batches taken off the queue and never trained (a dropped dataset iterator)."""
        with self._lock:
            for index, seq in zip(indices, seqs, strict=True):
                stats = self._entries[int(index)]
                stats.abandoned += 1
                if stats.shard is not None:
                    self.shards.lost(stats.shard, int(seq))

    def totals(self) -> Totals:
        """The aggregate counters."""
        with self._lock:
            return self._totals(self._gaps())

    def read(self) -> LedgerSnapshot:
        """Every counter an observer needs, in one lock: cheap enough for each tick or scrape."""
        with self._lock:
            gaps = self._gaps()
            return LedgerSnapshot(
                totals=self._totals(gaps),
                producers={
                    key: ProducerTotals(s.received, s.trained, s.sequence.missing + gaps.get(i, 0))
                    for key, i, s in self._keyed()
                },
                dropped=self._drops_by_reason(),
                peer_events=dict(self._peer_events),
                refused=self._refusals_by_reason(),
                ended=dict(self._ended),
                receiving_s=self._receiving_s(),
            )

    def _receiving_s(self) -> float:
        """Lock held: seconds from the first valid batch of any connection to the last."""
        firsts = [s.first_batch_at for s in self._entries.values() if s.first_batch_at is not None]
        if not firsts:
            return 0.0
        return max(s.last_seen for s in self._entries.values() if s.received) - min(firsts)

    def drops_by_reason(self) -> dict[str, int]:
        with self._lock:
            return self._drops_by_reason()

    def refusals_by_reason(self) -> dict[str, int]:
        with self._lock:
            return self._refusals_by_reason()

    def _totals(self, gaps: dict[int, int]) -> Totals:
        """Lock held; ``gaps`` from ``_gaps()``."""
        entries = self._entries.values()
        return Totals(
            received=sum(s.received for s in entries),
            received_bytes=sum(s.received_bytes for s in entries),
            enqueued=sum(s.enqueued for s in entries),
            trained=sum(s.trained for s in entries),
            dropped=sum(sum(s.drops.values()) for s in entries) + sum(self._unidentified.values()),
            seq_missing=sum(s.sequence.missing for s in entries) + sum(gaps.values()),
            abandoned=sum(s.abandoned for s in entries),
            queued=sum(s.queued for s in entries),
            not_enqueued=sum(s.not_enqueued for s in entries),
        )

    def _drops_by_reason(self) -> dict[str, int]:  # lock held
        out: collections.Counter[str] = collections.Counter(self._unidentified)
        for s in self._entries.values():
            out.update(s.drops)
        return dict(out)

    def _refusals_by_reason(self) -> dict[str, int]:  # lock held
        out: collections.Counter[str] = collections.Counter()
        for counts in self._refused.values():
            out.update(counts)
        return dict(out)

    def _keyed(self) -> list[tuple[str, int, ProducerStats]]:
        """(key, index, stats) per entry: the key fixed at ``open``, so a later connection
        claiming the same name never renames an earlier one's series. Lock held."""
        return [(s.key, i, s) for i, s in self._entries.items()]

    def refusals(self) -> dict[str, dict[str, int]]:
        """Refused hellos by declared producer name, then reason."""
        with self._lock:
            return {name: dict(c) for name, c in self._refused.items()}

    def summary(self) -> dict[str, dict]:
        """Per connection (plus ``<unidentified>`` for drops without one): every count, shaped
        for the end-of-run JSON. Observers read ``read()`` instead."""
        with self._lock:
            out: dict[str, dict] = {}
            gaps = self._gaps()
            for key, _, s in self._keyed():
                out[key] = {
                    "received": s.received,
                    "received_mb": round(s.received_bytes / MIB, 3),
                    "trained": s.trained,
                    "queued_at_stop": s.queued,
                    "abandoned": s.abandoned,
                    "not_enqueued": s.not_enqueued,
                    "dropped": dict(s.drops),
                    "ended_after": s.ended_after,
                    "end_reason": s.end_reason,
                    "end_detail": s.end_detail,
                    "seq_first": s.sequence.lowest,
                    "seq_last": s.sequence.highest,
                    "seq_missing": s.sequence.missing + gaps.get(s.index, 0),
                    "seq_duplicates": s.sequence.duplicates,
                    "trained_duplicates": s.trained_sequence.duplicates,
                    "active_s": round(max(s.last_seen - s.first_seen, 0.0), 3),
                }
            if self._unidentified:
                dropped = dict(self._unidentified)
                out[UNIDENTIFIED] = {"received": 0, "trained": 0, "dropped": dropped}
            return out

    def _log_drop(self, reason: DropReason, detail: str) -> None:
        if not self._log_throttle.due(reason.value):
            return
        log.warning("dropped message (%s): %s", reason.value, detail[:200])
