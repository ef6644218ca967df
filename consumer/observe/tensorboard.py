"""TensorBoard scalars: event files written by an eager ``tf.summary`` writer on its own thread.

The train loop only appends its ``StepRecord`` to a bounded deque (``record``); the thread
``stagefeed-tensorboard`` wakes every ``interval_s``, writes each pending step's scalars at that
step, then the window's figures at the latest step, and flushes. An eager writer works next to
the trainer's graph-mode session. Scalars are written with ``tf.summary.write`` and the
``scalars`` plugin's metadata, which is what ``tf.summary.scalar`` writes, so TensorBoard itself
need not be installed where the trainer runs. Tags are listed in docs/observability.md.

If writing fails (disk full, directory removed) the error is logged once and TensorBoard output
stops; training goes on.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.lifecycle import join_threads
from stagefeed.consumer.observe.figures import Figures, Snapshot

if TYPE_CHECKING:
    from stagefeed.consumer.run_facts import StepRecord

log = logging.getLogger(__name__)
v1 = tf.compat.v1

SCALAR = v1.SummaryMetadata(plugin_data=v1.SummaryMetadata.PluginData(plugin_name="scalars"))
TEXT = v1.SummaryMetadata(plugin_data=v1.SummaryMetadata.PluginData(plugin_name="text"))
# Steps waiting to be written; if the writer ever falls this far behind, the oldest are lost.
MAX_PENDING_STEPS = 10_000
JOIN_TIMEOUT_S = 10.0


def step_scalars(record: StepRecord) -> dict[str, float]:
    """Per-step tags, written at ``record.step`` (a record of several steps: per step)."""
    return {
        "step/ms": record.ms_per_step,
        "step/wait_ms": 1000.0 * record.wait_s / record.steps,
        "step/compute_ms": 1000.0 * record.step_s / record.steps,
        "step/loss": record.loss,
        "step/queue_batches": float(record.queue_batches),
    }


def window_scalars(f: Figures) -> dict[str, float]:
    """Per-window tags, written at ``f.last_step``; NaN figures are left out."""
    out = {
        "input/stall_pct": f.stall_pct,
        "input/received_mb_per_s": f.received_mb_per_s,
        "input/deliver_batches_per_s": f.deliver_per_s,
        "input/consume_batches_per_s": f.consume_per_s,
        "throughput/examples_per_s": f.examples_per_s,
        "throughput/ms_per_step": f.ms_per_step,
        "queue/batches": float(f.queue_batches),
        "queue/mb": f.queue_mb,
        "queue/mean_batches": f.queue_mean_batches,
        "queue/full_pct": f.queue_full_pct,
        "producers/seen": float(f.producers_seen),
        "producers/active": float(f.producers_active),
        "drops/total": float(f.dropped_total),
        "sequence/missing": float(f.seq_missing),
    }
    out.update({f"producers/batches_per_s/{p}": rate for p, rate in f.producer_per_s.items()})
    out.update({f"drops/{reason}": float(n) for reason, n in f.dropped.items()})
    return {tag: value for tag, value in out.items() if not math.isnan(value)}


class TensorBoardWriter:
    """Lifecycle: ``start()`` (makes the directory, opens the writer, starts the thread) ->
    ``record`` per step -> ``close(advice)`` (idempotent: stops and joins the thread, writes
    what is left and the final advice as text, closes the writer)."""

    def __init__(
        self,
        logdir: str,
        snapshot: Callable[[], Snapshot],
        figures: Callable[[Snapshot, Snapshot], Figures],
        interval_s: float = 2.0,
    ) -> None:
        self.logdir = logdir
        self.interval_s = interval_s
        self._snapshot = snapshot
        self._figures = figures
        self._pending: collections.deque[StepRecord] = collections.deque(maxlen=MAX_PENDING_STEPS)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one flush at a time (thread, then close)
        self._thread: threading.Thread | None = None
        self._writer: tf.summary.SummaryWriter | None = None
        self._last: Snapshot | None = None
        self._last_step = 0
        self._broken = False
        self._closed = False

    def start(self) -> TensorBoardWriter:
        try:
            os.makedirs(self.logdir, exist_ok=True)
            self._writer = tf.summary.create_file_writer(self.logdir)
        except (OSError, tf.errors.OpError) as exc:
            raise ConfigError(f"cannot write TensorBoard logs to {self.logdir!r}: {exc}") from None
        self._last = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="stagefeed-tensorboard")
        self._thread.start()
        log.info("TensorBoard scalars -> %s", self.logdir)
        return self

    def record(self, record: StepRecord) -> None:
        """Hot path: a deque append (thread-safe)."""
        self._pending.append(record)

    def close(self, advice: str | None = None) -> None:
        if self._closed or self._writer is None:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            join_threads([self._thread], JOIN_TIMEOUT_S)
        self._flush(advice)
        try:
            self._writer.close()
        except tf.errors.OpError as exc:
            log.error("closing TensorBoard writer for %s failed: %s", self.logdir, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._flush()

    def _flush(self, advice: str | None = None) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                self._write(advice)
            except (OSError, tf.errors.OpError) as exc:
                self._broken = True
                log.error("TensorBoard output to %s stopped: %s", self.logdir, exc)

    def _write(self, advice: str | None) -> None:
        assert self._writer is not None and self._last is not None
        records = []
        while self._pending:
            records.append(self._pending.popleft())
        snap = self._snapshot()
        with self._writer.as_default():
            for record in records:
                for tag, value in step_scalars(record).items():
                    _scalar(tag, value, record.step)
                self._last_step = record.step
            if snap.steps.steps > self._last.steps.steps:
                figures = self._figures(self._last, snap)
                for tag, value in window_scalars(figures).items():
                    _scalar(tag, value, figures.last_step)
                self._last = snap
            if advice:
                tf.summary.write("advice", tf.constant(advice), self._last_step, metadata=TEXT)
        self._writer.flush()


def _scalar(tag: str, value: float, step: int) -> None:
    tf.summary.write(tag, np.float32(value), step, metadata=SCALAR)
