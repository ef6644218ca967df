"""The trainer's books: every message received is trained, still queued at stop, or dropped."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable

from stagefeed.common.errors import DropReason
from stagefeed.common.sequence import SequenceTracker

log = logging.getLogger(__name__)

# Drops from messages whose producer is unknown (unparseable header, or never accepted) are
# booked here, so hostile ids cannot grow the ledger.
UNIDENTIFIED = "<unidentified>"
MAX_PRODUCERS = 1024
# At most one log line per reason in this many seconds: a junk flood must not flood the log.
DROP_LOG_INTERVAL_S = 5.0


@dataclasses.dataclass
class ProducerStats:
    """What one producer delivered. ``index`` is its small integer id inside the TF queue."""

    producer: str
    index: int
    first_seen: float
    last_seen: float = 0.0
    received: int = 0
    received_bytes: int = 0
    enqueued: int = 0
    trained: int = 0
    sequence: SequenceTracker = dataclasses.field(default_factory=SequenceTracker)
    trained_sequence: SequenceTracker = dataclasses.field(default_factory=SequenceTracker)


class Ledger:
    """Thread-safe accounting shared by the receive threads and the train loop.

    Invariant, per producer, at any quiescent moment::

        received == enqueued + in_hand + dropped(after header)   and
        enqueued == trained + queued (FIFOQueue + staging area)

    ``summary()`` reports ``queued_at_stop = enqueued - trained`` once training has stopped.
    """

    def __init__(self, max_producers: int = MAX_PRODUCERS) -> None:
        self._lock = threading.Lock()
        self._max_producers = max_producers
        self._by_id: dict[str, ProducerStats] = {}
        self._by_index: list[ProducerStats] = []
        self._drops: collections.Counter[tuple[str, str]] = collections.Counter()
        self._last_drop_log: dict[str, float] = {}
        self._peer_events: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()

    def accept(self, producer: str, seq: int, nbytes: int) -> int | None:
        """Book a valid message; return the producer's index, or None if it must be dropped."""
        now = time.monotonic()
        with self._lock:
            stats = self._by_id.get(producer)
            if stats is None:
                if len(self._by_index) >= self._max_producers:
                    reason, who = DropReason.PRODUCER_LIMIT, UNIDENTIFIED
                else:
                    stats = ProducerStats(producer, len(self._by_index), first_seen=now)
                    self._by_id[producer] = stats
                    self._by_index.append(stats)
                    log.info("producer %s connected (index %d)", producer, stats.index)
            if stats is not None:
                if stats.sequence.record(seq):
                    stats.received += 1
                    stats.received_bytes += nbytes
                    stats.last_seen = now
                    return stats.index
                reason, who = DropReason.DUPLICATE, producer
            self._drops[(who, reason.value)] += 1
        self._log_drop(reason, f"producer {producer} seq {seq}")
        return None

    def drop(self, reason: DropReason, detail: str, producer: str | None = None) -> None:
        """Book a malformed message. ``producer`` counts only if it delivered valid batches."""
        with self._lock:
            who = producer if producer in self._by_id else UNIDENTIFIED
            self._drops[(who, reason.value)] += 1
        self._log_drop(reason, detail)

    def enqueued(self, index: int) -> None:
        with self._lock:
            self._by_index[index].enqueued += 1

    def trained(self, indices: Iterable[int], seqs: Iterable[int]) -> None:
        """Book batches the train op consumed, identified by (producer index, seq)."""
        with self._lock:
            for index, seq in zip(indices, seqs, strict=True):
                stats = self._by_index[int(index)]
                stats.trained += 1
                stats.trained_sequence.record(int(seq))

    def peer_event(self, name: str) -> None:
        """Book a connection event of the bound socket (``consumer.peers`` names them)."""
        with self._lock:
            self._peer_events[name] += 1

    def peer_events(self) -> dict[str, int]:
        """Connection events so far: accepted, disconnected, handshake failures by kind."""
        with self._lock:
            return dict(self._peer_events)

    def producer_count(self) -> int:
        with self._lock:
            return len(self._by_index)

    def totals(self) -> dict[str, int]:
        """Cheap aggregate counters for progress lines and metrics."""
        with self._lock:
            return {
                "received": sum(s.received for s in self._by_index),
                "received_bytes": sum(s.received_bytes for s in self._by_index),
                "enqueued": sum(s.enqueued for s in self._by_index),
                "trained": sum(s.trained for s in self._by_index),
                "dropped": sum(self._drops.values()),
                "seq_missing": sum(s.sequence.missing for s in self._by_index),
            }

    def drops_by_reason(self) -> dict[str, int]:
        with self._lock:
            out: collections.Counter[str] = collections.Counter()
            for (_, reason), n in self._drops.items():
                out[reason] += n
            return dict(out)

    def summary(self) -> dict[str, dict]:
        """Per producer (plus ``<unidentified>`` for drops without one): every count."""
        with self._lock:
            out: dict[str, dict] = {}
            for s in self._by_index:
                out[s.producer] = {
                    "received": s.received,
                    "received_mb": round(s.received_bytes / 2**20, 3),
                    "trained": s.trained,
                    "queued_at_stop": s.enqueued - s.trained,
                    "not_enqueued": s.received - s.enqueued,
                    "dropped": {},
                    "seq_first": s.sequence.lowest,
                    "seq_last": s.sequence.highest,
                    "seq_missing": s.sequence.missing,
                    "seq_duplicates": s.sequence.duplicates,
                    "trained_duplicates": s.trained_sequence.duplicates,
                    "active_s": round(max(s.last_seen - s.first_seen, 0.0), 3),
                }
            for (who, reason), n in sorted(self._drops.items()):
                entry = out.setdefault(who, {"received": 0, "trained": 0, "dropped": {}})
                entry["dropped"][reason] = n
            return out

    def _log_drop(self, reason: DropReason, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last_drop_log.get(reason.value, -1e9)
            if now - last < DROP_LOG_INTERVAL_S:
                return
            self._last_drop_log[reason.value] = now
            total = sum(n for (_, r), n in self._drops.items() if r == reason.value)
        log.warning("dropped message (%s, %d so far): %s", reason.value, total, detail[:200])
