"""The books of the TF 2 feed: which dequeued batches each train step consumed, and input waits.

tf.data dequeues ahead of training (prefetch, the device buffer), so a dequeue is not a trained
batch. The pipeline writes one entry per dequeued batch into a side FIFOQueue, the
``DequeueLog``; after each step a hook (the Keras callback, or ``StepBooks.step_done`` in a
custom loop) pops exactly the entries of the batches that step consumed.

Entries carry the generation of the iterator that dequeued them (a ticket taken when an
iterator starts) and their index within it. A step always consumes the next batches of the
newest iterator; entries of older iterators are *abandoned*: dequeued into buffers that were
dropped untrained (Keras 3 draws one batch from a throwaway iterator before ``fit`` under a
strategy; every iterator's buffers are lost when it is dropped at the end of ``fit``).

Invariant, at any quiescent moment (no dequeue in progress)::

    enqueued == trained + abandoned + in_flight + in_queue        (unaccounted == 0)

``in_flight``: dequeued by the live iterator, not yet trained. Queued at stop is
``in_flight + in_queue``. ``unbooked`` counts trained batches whose entry was lost because the
log was full (only if steps are not booked for ``log capacity`` dequeues); they are trained
but cannot be named to the sink.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import NamedTuple, Protocol

import numpy as np
import tensorflow as tf

from stagefeed.consumer.devices import HOST
from stagefeed.consumer.tf2.eager_queue import EagerQueueFeed

log = logging.getLogger(__name__)


class BooksSink(Protocol):
    """Where trained batches are booked (``Ledger.trained`` has this signature).

    A sink may also have ``abandoned(peers, seqs)``; it is called when it exists.
    """

    def trained(self, peers: list[int], seqs: list[int]) -> None: ...


class TrainedStep(NamedTuple):
    """The batches one booked step trained, in the order the step consumed them: each is
    ``(peers[i], seqs[i])``, the producer's connection index in the books (``Ledger``; a
    ``ServedFeed`` names it with ``producer_name``) and the batch's sequence number.
    ``step``: how many steps the feed has booked, this one included."""

    step: int
    peers: tuple[int, ...]
    seqs: tuple[int, ...]


class Entry(NamedTuple):
    generation: int
    batch_index: int  # within its iterator (a field named index would hide tuple.index)
    peer: int
    seq: int
    wait_s: float  # how long the dequeue blocked on an empty queue
    fill: int  # batches in the queue when the dequeue was issued


_ENTRY_DTYPES = [tf.int64, tf.int64, tf.int32, tf.int64, tf.float64, tf.int32]


class DequeueLog:
    """Side FIFOQueue of ``Entry`` (host CPU, created eagerly) and the iterator ticket roll.

    ``record`` never blocks the pipeline: when the log is full the entry is dropped (the books
    then count the batch as ``unbooked``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        with tf.device(HOST):
            self.entries = tf.queue.FIFOQueue(
                capacity, _ENTRY_DTYPES, shapes=[[]] * len(_ENTRY_DTYPES), name="stagefeed_log"
            )
            # One element, the next generation: dequeue + enqueue is an atomic counter.
            self.tickets = tf.queue.FIFOQueue(1, [tf.int64], shapes=[[]], name="stagefeed_tickets")
        self.tickets.enqueue(np.int64(1))

    def take_ticket(self) -> tf.Tensor:
        """(Dataset function) this iterator's generation; the next one gets a higher one."""
        ticket = self.tickets.dequeue()
        with tf.control_dependencies([self.tickets.enqueue(ticket + 1)]):
            return tf.identity(ticket)

    def record(self, *entry: tf.Tensor) -> tf.Tensor:
        """(Dataset function) append an entry unless the log is full; returns a dependency."""

        def put() -> tf.Tensor:
            with tf.control_dependencies([self.entries.enqueue(list(entry))]):
                return tf.constant(True)

        return tf.cond(self.entries.size() < self.capacity, put, lambda: tf.constant(False))

    def drain(self) -> list[Entry]:
        """(Eager, one caller at a time) every entry logged so far, in dequeue order."""
        count = int(self.entries.size())
        if count == 0:
            return []
        columns = [c.numpy().tolist() for c in self.entries.dequeue_many(count)]
        return [Entry(*row) for row in zip(*columns, strict=True)]


@dataclasses.dataclass(frozen=True)
class BooksFigures:
    """A snapshot of the books. ``input_wait``: see docs/tf2.md, "The stall figure"."""

    enqueued: int
    trained: int
    abandoned: int
    in_flight: int
    in_queue: int
    unbooked: int
    steps: int
    wait_s: float  # total dequeue wait of the trained batches, this run
    elapsed_s: float  # wall time of this run (begin() to now, or to end())
    queue_capacity: int

    @property
    def queued(self) -> int:
        """Batches still to be trained if training went on: in the queue or the buffers."""
        return self.in_flight + self.in_queue

    @property
    def unaccounted(self) -> int:
        """0 whenever no dequeue is in progress; anything else is a bookkeeping loss."""
        return self.enqueued - self.trained - self.abandoned - self.queued

    @property
    def input_wait(self) -> float:
        """Share (0..1) of the run's wall time the trained batches' dequeues waited."""
        return min(1.0, self.wait_s / self.elapsed_s) if self.elapsed_s > 0 else 0.0

    def logs(self, prefix: str = "stagefeed_") -> dict[str, float]:
        """The figures a Keras callback adds to ``fit``'s logs and history."""
        return {
            f"{prefix}trained": float(self.trained),
            f"{prefix}abandoned": float(self.abandoned),
            f"{prefix}queue_fill": self.in_queue / self.queue_capacity,
            f"{prefix}input_wait": self.input_wait,
        }


class StepBooks:
    """Books the batches consumed by train steps; thread-safe, one instance per feed.

    ``batches_per_step``: queue elements one step consumes (the number of local replicas when
    the dataset is distributed from a function, else 1); set by ``Feed.dataset``.
    """

    def __init__(
        self, queue: EagerQueueFeed, dequeues: DequeueLog, sink: BooksSink | None = None
    ) -> None:
        self.queue = queue
        self.dequeues = dequeues
        self.sink = sink
        self.batches_per_step = 1
        self._lock = threading.Lock()
        self._pending: collections.deque[Entry] = collections.deque()
        self._unnotified: list[Entry] = []  # abandoned, not yet told to the sink
        self._generation = 0  # newest iterator seen
        self._retired = 0  # iterators up to this generation are dropped
        self._next_index = 0  # index, in the newest iterator, of the next batch to train
        self._trained = self._abandoned = self._unbooked = self._steps = 0
        self._wait_s = 0.0
        self._log_filled = False  # the log was full once: entries may have been dropped
        self._began: float | None = None
        self._ended: float | None = None
        self._last_step: TrainedStep | None = None

    @property
    def last_step(self) -> TrainedStep | None:
        """What the latest booked step trained (None before the first)."""
        return self._last_step

    def begin(self) -> None:
        """Start a run's clock (``fit``: on_train_begin). Implied by the first ``step_done``."""
        with self._lock:
            self._began, self._ended, self._wait_s = time.monotonic(), None, 0.0

    def step_done(self, steps: int = 1) -> tuple[list[int], list[int]]:
        """Book ``steps`` steps just finished; returns the (peers, seqs) booked as trained."""
        with self._lock:
            if self._began is None:
                self._began = time.monotonic()
            self._absorb(self.dequeues.drain())
            peers: list[int] = []
            seqs: list[int] = []
            for _ in range(steps * self.batches_per_step):
                if self._pending and self._pending[0].batch_index == self._next_index:
                    entry = self._pending.popleft()
                    peers.append(entry.peer)
                    seqs.append(entry.seq)
                    self._wait_s += entry.wait_s
                elif self._ended_early():
                    break  # the data ended inside a multi-step call: fewer batches than steps
                else:
                    self._unbooked += 1
                    if self._unbooked == 1:
                        log.warning("a trained batch has no dequeue log entry (log full?)")
                self._next_index += 1
                self._trained += 1
            self._steps += steps
            self._last_step = TrainedStep(self._steps, tuple(peers), tuple(seqs))
            abandoned, self._unnotified = self._unnotified, []
        self._notify(abandoned)
        if seqs and self.sink is not None:
            self.sink.trained(peers, seqs)
        return peers, seqs

    def end(self) -> None:
        """Training stopped: the newest iterator is dropped; its buffered batches are abandoned."""
        with self._lock:
            self._absorb(self.dequeues.drain())
            self._retired = self._generation
            self._abandon(list(self._pending))
            self._pending.clear()
            if self._began is not None and self._ended is None:
                self._ended = time.monotonic()
            abandoned, self._unnotified = self._unnotified, []
        self._notify(abandoned)

    def figures(self) -> BooksFigures:
        """Drain the log and snapshot the books (exact when no dequeue is in progress)."""
        with self._lock:
            self._absorb(self.dequeues.drain())
            now = self._ended or time.monotonic()
            figures = BooksFigures(
                enqueued=self.queue.enqueued,
                trained=self._trained,
                abandoned=self._abandoned,
                in_flight=len(self._pending),
                in_queue=self.queue.size(),
                unbooked=self._unbooked,
                steps=self._steps,
                wait_s=self._wait_s,
                elapsed_s=now - self._began if self._began is not None else 0.0,
                queue_capacity=self.queue.capacity,
            )
            abandoned, self._unnotified = self._unnotified, []
        self._notify(abandoned)
        return figures

    def _ended_early(self) -> bool:
        """No entry for the next batch because there is none: the queue is closed and empty.

        Unless the log was ever full: then the entry may have been dropped (``unbooked``).
        """
        if self._pending or self._log_filled or not self.queue.closed:
            return False
        return self.queue.size() == 0

    def _absorb(self, entries: list[Entry]) -> None:
        if len(entries) >= self.dequeues.capacity:
            self._log_filled = True
        for entry in entries:
            if entry.generation <= self._retired or entry.generation < self._generation:
                self._abandon([entry])
            elif entry.generation > self._generation:
                self._abandon(list(self._pending))
                self._pending.clear()
                self._generation, self._next_index = entry.generation, 0
                self._pending.append(entry)
            else:
                self._pending.append(entry)

    def _abandon(self, entries: list[Entry]) -> None:
        self._abandoned += len(entries)
        self._unnotified.extend(entries)

    def _notify(self, entries: list[Entry]) -> None:
        """Tell the sink, outside the lock, of abandoned batches (if it has ``abandoned``)."""
        notify = getattr(self.sink, "abandoned", None)
        if entries and callable(notify):
            notify([e.peer for e in entries], [e.seq for e in entries])
