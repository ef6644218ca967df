"""Windows of figures built the way the Monitor builds them: two snapshots, then
``figures_between``. Only the inputs are chosen here; every figure is computed by the product."""

from __future__ import annotations

import dataclasses
import math

from stagefeed.consumer.books.ledger import LedgerSnapshot, ProducerTotals, Totals
from stagefeed.consumer.observe.figures import Figures, Snapshot, StepTotals, figures_between
from stagefeed.consumer.run_facts import RunFacts

BATCH_BYTES = 2 * 227 * 227 * 3 * 4  # --batch-size 2, float32


def facts(
    batch_bytes: int = BATCH_BYTES, wire_dtype: str = "float32", capacity: int = 100
) -> RunFacts:
    """A trainer of batches of 2 on the CPU."""
    return RunFacts("/cpu:0", 2, batch_bytes, wire_dtype, capacity)


def window(
    seconds: float = 10.0,
    steps: int = 20,
    wait_s: float = 0.0,
    step_s: float = 2.0,
    per_producer: dict[str, int] | None = None,
    queue_batches: int = 0,
    queue_sum: int = 0,
    full_steps: int = 0,
    capacity: int = 100,
    dropped: dict[str, int] | None = None,
    seq_missing: int = 0,
    batch_bytes: int = BATCH_BYTES,
    wire_dtype: str = "float32",
    producer_capacity_per_s: float = float("nan"),
) -> Figures:
    """Figures of a window of ``seconds`` in which ``per_producer`` batches were received.

    Every producer named delivered one batch before the window, so each one counts as seen.
    """
    per_producer = {"p0": 20} if per_producer is None else per_producer
    start = Snapshot(
        at=1000.0,
        steps=StepTotals(),
        queue_batches=0,
        books=_books({name: 1 for name in per_producer}, batch_bytes),
    )
    end = Snapshot(
        at=1000.0 + seconds,
        steps=StepTotals(
            steps=steps,
            last_step=steps,
            wait_s=wait_s,
            step_s=step_s,
            queue_sum=queue_sum,
            full_steps=full_steps,
            loss=6.9,
        ),
        queue_batches=queue_batches,
        books=_books(
            {name: 1 + n for name, n in per_producer.items()}, batch_bytes, seq_missing, dropped
        ),
    )
    f = figures_between(start, end, facts(batch_bytes, wire_dtype, capacity))
    if not math.isnan(producer_capacity_per_s):
        f = dataclasses.replace(f, producer_capacity_per_s=producer_capacity_per_s)
    return f


def _books(
    received: dict[str, int],
    batch_bytes: int,
    seq_missing: int = 0,
    dropped: dict[str, int] | None = None,
) -> LedgerSnapshot:
    total = sum(received.values())
    return LedgerSnapshot(
        totals=Totals(
            received=total, received_bytes=total * batch_bytes, seq_missing=seq_missing
        ),
        producers={name: ProducerTotals(n, n, 0) for name, n in received.items()},
        dropped=dict(dropped or {}),
    )
