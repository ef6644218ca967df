"""Figures: per-step counters, snapshots read through a ``RunReader`` of a real ledger, windows.

No trainer: observers see a run only through ``RunFacts`` and a ``RunReader``.
"""

from __future__ import annotations

import math
import threading

import pytest

from stagefeed.common.errors import DropReason
from stagefeed.common.schema import image_schema
from stagefeed.consumer.books.ledger import Ledger, LedgerSnapshot, ProducerTotals, Totals
from stagefeed.consumer.observe.figures import (
    Snapshot,
    StepCounters,
    StepTotals,
    empty_snapshot,
    figures_between,
    take_snapshot,
)
from stagefeed.consumer.run_facts import RunFacts, RunReader, StepRecord

SPEC = image_schema(batch_size=2)
FACTS = RunFacts("/cpu:0", 2, SPEC.batch_bytes, "float32", queue_capacity=10)


def record(step: int, wait_s: float, step_s: float, queue: int, loss: float = 6.9) -> StepRecord:
    return StepRecord(step, True, wait_s, step_s, loss, queue, at=0.0)


def test_counters_sum_steps_and_count_full_queue_starts() -> None:
    counters = StepCounters(queue_capacity=4)
    counters.add(record(1, 0.5, 0.1, queue=0))
    counters.add(record(2, 0.0, 0.2, queue=4))
    counters.add(record(3, 0.25, 0.3, queue=3, loss=5.0))
    t = counters.read()
    assert (t.steps, t.last_step, t.queue_sum, t.full_steps) == (3, 3, 7, 1)
    assert t.wait_s == pytest.approx(0.75)
    assert t.step_s == pytest.approx(0.6)
    assert t.loss == 5.0


def test_counters_are_consistent_across_threads() -> None:
    counters = StepCounters(queue_capacity=1)

    def add_many() -> None:
        for i in range(2000):
            counters.add(record(i, 0.001, 0.002, queue=1))

    threads = [threading.Thread(target=add_many, name=f"adder-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    t = counters.read()
    assert t.steps == t.full_steps == 8000
    assert t.wait_s == pytest.approx(8.0)


def test_window_figures() -> None:
    a = Snapshot(
        at=100.0,
        steps=StepTotals(steps=10, last_step=10, wait_s=1.0, step_s=1.0, queue_sum=50),
        queue_batches=5,
        books=LedgerSnapshot(
            totals=Totals(received=30, received_bytes=30 * SPEC.batch_bytes, seq_missing=1),
            producers={"a": ProducerTotals(30, 10, 1)},
            dropped={"duplicate": 2},
        ),
    )
    b = Snapshot(
        at=104.0,
        steps=StepTotals(
            steps=30, last_step=30, wait_s=3.0, step_s=7.0, queue_sum=90, full_steps=5, loss=2.0
        ),
        queue_batches=7,
        books=LedgerSnapshot(
            totals=Totals(received=62, received_bytes=62 * SPEC.batch_bytes, seq_missing=1),
            producers={
                "a": ProducerTotals(46, 20, 1),
                "b": ProducerTotals(16, 10, 0),
                "hello-only": ProducerTotals(0, 0, 0),
            },
            dropped={"duplicate": 2, "dtype": 3},
        ),
    )
    f = figures_between(a, b, FACTS)
    assert f.seconds == pytest.approx(4.0)
    assert f.steps == 20 and f.last_step == 30
    assert f.stall_pct == pytest.approx(25.0)  # 2 s waited of 8 s
    assert f.ms_per_step == pytest.approx(400.0)
    assert f.compute_ms == pytest.approx(300.0)
    assert f.consume_per_s == pytest.approx(20 / 6.0)
    assert f.step_per_s == pytest.approx(5.0)
    assert f.examples_per_s == pytest.approx(10.0)
    assert f.deliver_per_s == pytest.approx(8.0)
    assert f.received_mb_per_s == pytest.approx(8.0 * SPEC.batch_bytes / 2**20)
    assert f.queue_mean_batches == pytest.approx(2.0)
    assert f.queue_full_pct == pytest.approx(25.0)
    assert f.queue_mb == pytest.approx(7 * SPEC.batch_bytes / 2**20)
    assert f.queue_capacity == 10 and f.batch_size == 2 and f.wire_dtype == "float32"
    assert f.producer_per_s == {"a": pytest.approx(4.0), "b": pytest.approx(4.0), "hello-only": 0}
    # A connection that only said hello has delivered nothing: not seen, not active.
    assert (f.producers_seen, f.producers_active) == (2, 2)
    assert f.dropped == {"dtype": 3} and f.dropped_total == 3
    assert f.seq_missing == 0
    assert f.loss == 2.0
    assert math.isnan(f.producer_capacity_per_s)


def test_window_without_steps_has_no_step_figures() -> None:
    a = empty_snapshot(10.0)
    books = LedgerSnapshot(Totals(received=3))
    b = Snapshot(at=12.0, steps=StepTotals(), queue_batches=3, books=books)
    f = figures_between(a, b, FACTS)
    assert f.steps == 0
    for value in (f.stall_pct, f.ms_per_step, f.consume_per_s, f.queue_full_pct):
        assert math.isnan(value)
    assert f.deliver_per_s == pytest.approx(1.5)
    assert f.producers_active == 0


def test_snapshot_reads_the_books_and_the_queue_through_the_reader() -> None:
    ledger = Ledger()
    a, b = ledger.open("prod-a"), ledger.open("prod-b")
    for seq in (0, 1, 3):
        ledger.accept(a, seq, SPEC.batch_bytes)
    ledger.accept(b, 0, SPEC.batch_bytes)
    ledger.accept(b, 0, SPEC.batch_bytes)  # duplicate
    ledger.drop(DropReason.HEADER_NOT_MSGPACK, "junk")
    ledger.trained([a], [0])
    fill = [1]
    reader = RunReader(queue_batches=lambda: fill[0], books=ledger.read)
    counters = StepCounters(queue_capacity=2)
    counters.add(record(1, 0.1, 0.2, queue=2))
    snap = take_snapshot(counters, reader)
    assert snap.steps.steps == 1 and snap.steps.full_steps == 1
    assert snap.queue_batches == 1
    assert snap.books == ledger.read()
    assert snap.books.totals.received == 4
    assert snap.books.totals.seq_missing == 1  # prod-a: seq 2 never came
    assert snap.books.producers == {
        "prod-a": ProducerTotals(3, 1, 1),
        "prod-b": ProducerTotals(1, 0, 0),
    }
    # A step's dequeue can let an enqueue finish before the loop counts it: clipped.
    fill[0] = 3
    assert take_snapshot(counters, reader).queue_batches == 2
