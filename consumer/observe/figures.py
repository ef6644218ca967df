"""The figures of a run: cumulative counters fed per step, snapshots, and windows between them.

Observers see a run through two narrow things, never the trainer: ``RunFacts`` (fixed for the
run: batch size and bytes, queue capacity, device) and a ``RunReader`` (the queue fill now and
one typed read of the ledger's books), both in ``consumer.run_facts``.

The train loop's per-step cost is ``StepCounters.add``: a lock and a few additions, no TF call
and no ledger read. Everything else (ledger reads, rates, per-producer figures) happens when a
sink asks for a ``Snapshot``: a progress tick, a TensorBoard flush, a Prometheus scrape.

A window ``figures_between(a, b, facts)`` turns two snapshots into rates over ``b.at - a.at``
seconds.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

from stagefeed.common.options import MIB
from stagefeed.consumer.books.ledger import LedgerSnapshot
from stagefeed.consumer.observe.host_cpu import CpuTimes, busy_pct, host_cores, read_cpu_times
from stagefeed.consumer.run_facts import RunFacts, RunReader, StepRecord


@dataclasses.dataclass(frozen=True)
class StepTotals:
    """Sums over every step so far (warm-up included)."""

    steps: int = 0
    last_step: int = 0
    wait_s: float = 0.0  # time steps waited for input before they could run
    step_s: float = 0.0  # the rest of each step: the session.run of the train op
    queue_sum: int = 0  # sum over steps of the FIFOQueue fill when the step started
    full_steps: int = 0  # steps that started with the FIFOQueue full
    loss: float = math.nan  # of the latest step


class StepCounters:
    """Thread-safe running sums; ``add`` runs on the train loop, ``read`` anywhere."""

    def __init__(self, queue_capacity: int) -> None:
        self.queue_capacity = queue_capacity
        self._lock = threading.Lock()
        self._totals = StepTotals()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            t = self._totals
            self._totals = StepTotals(
                steps=t.steps + record.steps,
                last_step=record.step,
                wait_s=t.wait_s + record.wait_s,
                step_s=t.step_s + record.step_s,
                queue_sum=t.queue_sum + record.queue_batches * record.steps,
                full_steps=t.full_steps
                + record.steps * (record.queue_batches >= self.queue_capacity),
                loss=record.loss,
            )

    def read(self) -> StepTotals:
        with self._lock:
            return self._totals


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Every cumulative figure at one moment (``at``: ``time.monotonic()``)."""

    at: float
    steps: StepTotals
    queue_batches: int  # FIFOQueue fill now (lower bound, see ``Trainer.queue_batches``)
    books: LedgerSnapshot = LedgerSnapshot()
    cpu: CpuTimes | None = None  # the host's core time so far (None: unknown)


def take_snapshot(counters: StepCounters, reader: RunReader) -> Snapshot:
    """Read the step counters, the queue fill and the books (one ledger lock)."""
    return Snapshot(
        at=time.monotonic(),
        steps=counters.read(),
        # The count can pass the capacity by one while a step runs: its dequeue let an enqueue
        # finish before the train loop counted the dequeue.
        queue_batches=min(reader.queue_batches(), counters.queue_capacity),
        books=reader.books(),
        cpu=read_cpu_times(),
    )


def empty_snapshot(at: float | None = None) -> Snapshot:
    """The state before anything happened: the baseline of the first window."""
    return Snapshot(
        at=time.monotonic() if at is None else at,
        steps=StepTotals(),
        queue_batches=0,
        cpu=read_cpu_times(),
    )


@dataclasses.dataclass(frozen=True)
class Figures:
    """What happened between two snapshots. Rates are per second of wall time in the window.

    ``stall_pct`` is the share of step time spent waiting for input: the sum of ``wait_s`` over
    the sum of ``wait_s + step_s``. ``consume_per_s`` is how many batches per second the step
    itself would take if it never waited (steps / compute seconds); ``deliver_per_s`` is how many
    the producers delivered (valid batches received). NaN where a figure has no data.
    """

    seconds: float
    steps: int
    last_step: int
    batch_size: int
    batch_mb: float
    wire_dtype: str
    stall_pct: float
    ms_per_step: float
    compute_ms: float
    examples_per_s: float
    step_per_s: float
    consume_per_s: float
    deliver_per_s: float
    received_mb_per_s: float
    queue_batches: int
    queue_capacity: int
    queue_mean_batches: float
    queue_full_pct: float
    producers_seen: int  # delivered a valid batch, in this window or before
    producers_active: int  # delivered at least one batch in the window
    producer_per_s: dict[str, float]
    dropped: dict[str, int]  # in the window, by reason
    seq_missing: int  # in the window (late arrivals can make it negative)
    loss: float
    # Best batches/s one producer was seen to deliver while not held back by a full queue
    # (NaN: never observed). Filled in by the caller that tracks it across windows.
    producer_capacity_per_s: float = math.nan
    host_cores: int = 0  # the cores of the trainer's host (0: unknown)
    host_busy_pct: float = math.nan  # the share of their time spent working in the window

    @property
    def queue_mb(self) -> float:
        return self.queue_batches * self.batch_mb

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


def figures_between(a: Snapshot, b: Snapshot, facts: RunFacts) -> Figures:
    """The window from snapshot ``a`` to the later snapshot ``b``."""
    seconds = max(b.at - a.at, 1e-9)
    steps = b.steps.steps - a.steps.steps
    wait_s = b.steps.wait_s - a.steps.wait_s
    step_s = b.steps.step_s - a.steps.step_s
    busy = wait_s + step_s
    was, now = a.books, b.books
    per_producer = {
        name: (p.received - (was.producers[name].received if name in was.producers else 0))
        / seconds
        for name, p in now.producers.items()
    }
    dropped = {
        reason: n - was.dropped.get(reason, 0)
        for reason, n in now.dropped.items()
        if n - was.dropped.get(reason, 0)
    }
    return Figures(
        seconds=seconds,
        steps=steps,
        last_step=b.steps.last_step,
        batch_size=facts.batch_size,
        batch_mb=facts.batch_bytes / MIB,
        wire_dtype=facts.wire_dtype,
        stall_pct=100.0 * wait_s / busy if steps and busy > 0 else math.nan,
        ms_per_step=1000.0 * busy / steps if steps else math.nan,
        compute_ms=1000.0 * step_s / steps if steps else math.nan,
        examples_per_s=steps * facts.batch_size / seconds,
        step_per_s=steps / seconds,
        consume_per_s=steps / step_s if steps and step_s > 0 else math.nan,
        deliver_per_s=(now.totals.received - was.totals.received) / seconds,
        received_mb_per_s=(now.totals.received_bytes - was.totals.received_bytes) / MIB / seconds,
        queue_batches=b.queue_batches,
        queue_capacity=facts.queue_capacity,
        queue_mean_batches=(b.steps.queue_sum - a.steps.queue_sum) / steps if steps else math.nan,
        queue_full_pct=100.0 * (b.steps.full_steps - a.steps.full_steps) / steps
        if steps
        else math.nan,
        producers_seen=now.delivering,
        producers_active=sum(rate > 0 for rate in per_producer.values()),
        producer_per_s=per_producer,
        dropped=dropped,
        seq_missing=now.totals.seq_missing - was.totals.seq_missing,
        loss=b.steps.loss,
        host_cores=host_cores(),
        host_busy_pct=busy_pct(a.cpu, b.cpu),
    )
