"""The trainer's one step observer: counts, shows progress, advises, and feeds the exporters.

Per step (on the train loop) the ``Monitor`` adds the ``StepRecord`` to Python counters and
appends its time to a bounded deque (and, for TensorBoard, the record to another): no TF call,
no ledger read. When a progress line,
an advice line or a capacity sample is due it takes one ``Snapshot`` and works on windows of
snapshots. The Prometheus endpoint and the TensorBoard writer run on their own named threads
and read snapshots themselves.

It sees the run only through the ``RunFacts`` and the ``RunReader`` given to ``start``. At
``close`` it computes the run's ``FinalFigures``, the one source of the summary's step figures
and of the final advice.

Lifecycle: ``Monitor(options)`` -> ``start(facts, reader)`` (binds the metrics port, opens the
logdir; ``ConfigError`` if either fails) -> ``on_step`` ... -> ``close()`` (idempotent: ends the
progress line, computes ``final``, writes and closes TensorBoard, stops the HTTP server).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import MIB, ObserveOptions
from stagefeed.common.stats import percentile
from stagefeed.consumer.observe.advice import Advice, advise
from stagefeed.consumer.observe.figures import (
    Figures,
    Snapshot,
    StepCounters,
    empty_snapshot,
    figures_between,
    take_snapshot,
)
from stagefeed.consumer.observe.progress import Progress
from stagefeed.consumer.run_facts import RunFacts, RunReader

if TYPE_CHECKING:
    from stagefeed.consumer.run_facts import StepRecord

log = logging.getLogger("stagefeed.monitor")

# Producer capacity is sampled over windows at least this long.
CAPACITY_WINDOW_S = 1.0
# Step times kept for the final percentiles: the most recent ones, so memory stays bounded on
# runs that never end (``--steps 0``).
MAX_STEP_TIMES = 10_000


@dataclasses.dataclass(frozen=True)
class FinalFigures:
    """The run's figures, computed once at the end: the summary and the final advice read them.

    ``window`` runs from the end of the last warm-up step (with no warm-up: of the first step,
    whose graph set-up would count as compute) to the close; from the start if no step came
    after that. The percentiles are of ``wait_s + step_s`` of the window's steps (the last
    ``MAX_STEP_TIMES`` of them); NaN without steps. ``advice`` judges ``window``.
    ``received_mb_per_s`` is over the time batches were received, from the run's first valid
    batch to its last (NaN with fewer than two batches apart): producers may deliver every
    batch before the window begins (a cluster's first step takes seconds), which the window's
    own rate shows as 0.
    """

    window: Figures
    median_ms: float
    p10_ms: float
    p90_ms: float
    advice: Advice
    received_mb_per_s: float = math.nan


class Monitor:
    """A ``StepObserver``; see the module docstring for what runs where."""

    def __init__(self, options: ObserveOptions, stream: Any = None) -> None:
        self.options = options
        self.progress = Progress(options.progress_s, stream)
        self.final: FinalFigures | None = None  # once started and closed
        self.capacity_per_s = math.nan  # best unthrottled batches/s of one producer
        self._facts: RunFacts | None = None
        self._reader: RunReader | None = None
        # Set by ``start``, where the run's window begins (nothing reads them before).
        self._counters: StepCounters
        self._origin: Snapshot
        self._shown: Snapshot
        self._advised: Snapshot
        self._sampled: Snapshot
        # When each was last done, on the step records' clock (time.monotonic()).
        self._shown_at: float
        self._advised_at: float
        self._sampled_at: float
        self._final_base: Snapshot | None = None
        # (step, wait_s + step_s in ms) of the latest steps.
        self._step_ms: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=MAX_STEP_TIMES
        )
        self._metrics: Any = None
        self._tensorboard: Any = None
        self._closed = False

    def start(self, facts: RunFacts, reader: RunReader) -> Monitor:
        self._facts, self._reader = facts, reader
        self._counters = StepCounters(facts.queue_capacity)
        self._origin = self._shown = self._advised = self._sampled = empty_snapshot()
        self._shown_at = self._advised_at = self._sampled_at = self._origin.at
        opts = self.options
        if opts.metrics_port is not None:
            try:
                from stagefeed.consumer.observe.prometheus import MetricsServer
            except ImportError as exc:
                raise ConfigError(
                    f"--metrics-port needs prometheus-client ({exc}); "
                    "install it with pip install 'stagefeed[metrics]'"
                ) from None
            self._metrics = MetricsServer(
                self.snapshot,
                facts,
                opts.metrics_bind,
                opts.metrics_port,
                producer_labels=opts.metrics_producer_labels,
            ).start()
        if opts.logdir is not None:
            from stagefeed.consumer.observe.tensorboard import TensorBoardWriter

            self._tensorboard = TensorBoardWriter(
                opts.logdir, self.snapshot, self.figures, opts.tensorboard_s
            ).start()
        return self

    def snapshot(self) -> Snapshot:
        assert self._reader is not None, "Monitor.start(facts, reader) first"
        return take_snapshot(self._counters, self._reader)

    def figures(self, a: Snapshot, b: Snapshot) -> Figures:
        """The window from ``a`` to ``b``, with the producer capacity seen so far."""
        assert self._facts is not None, "Monitor.start(facts, reader) first"
        f = figures_between(a, b, self._facts)
        return dataclasses.replace(f, producer_capacity_per_s=self.capacity_per_s)

    def advice(self, f: Figures) -> Advice:
        return advise(f, self.options.wire_mb_s)

    def on_step(self, record: StepRecord) -> None:
        self._counters.add(record)
        self._step_ms.append((record.step, record.ms_per_step))
        if self._tensorboard is not None:
            self._tensorboard.record(record)
        now = record.at
        is_base = not record.timed or record.step <= record.steps  # or the first record
        show = now - self._shown_at >= self.progress.interval_s
        advise_now = now - self._advised_at >= self.options.advice_s
        sample = now - self._sampled_at >= CAPACITY_WINDOW_S
        if not (is_base or show or advise_now or sample):
            return
        snap = self.snapshot()
        if is_base:
            # The final figures start after the warm-up (or the first step): its graph set-up
            # and the producers' start would otherwise count as stall and slow delivery.
            self._final_base = snap
        if sample:
            self._sample_capacity(self._sampled, snap)
            self._sampled, self._sampled_at = snap, now
        if show:
            self.progress.show(self.figures(self._shown, snap), self._planned)
            self._shown, self._shown_at = snap, now
        if advise_now:
            self.progress.break_line()
            log.info("advice: %s", self.advice(self.figures(self._advised, snap)).text)
            self._advised, self._advised_at = snap, now

    def _final_figures(self, end: Snapshot) -> FinalFigures:
        """See ``FinalFigures``; ``end`` is the snapshot taken at the close."""
        base = self._final_base
        if base is None or end.steps.steps <= base.steps.steps:
            base = self._origin
        window = self.figures(base, end)
        first = base.steps.last_step  # the window's steps come after this one
        ms = [t for step, t in self._step_ms if step > first]
        return FinalFigures(
            window,
            median_ms=percentile(ms, 50),
            p10_ms=percentile(ms, 10),
            p90_ms=percentile(ms, 90),
            advice=self.advice(window),
            received_mb_per_s=received_rate(end),
        )

    def close(self) -> None:
        """Idempotent. Sets ``final`` (once started); stops the exporters' threads."""
        if self._closed:
            return
        self._closed = True
        if self._facts is not None:
            end = self.snapshot()
            if end.steps.steps > self._shown.steps.steps:
                # The last steps since the last line: the line ends on the final step count.
                self.progress.show(self.figures(self._shown, end), self._planned)
            self.final = self._final_figures(end)
        self.progress.finish()
        text = self.final.advice.text if self.final is not None else None
        try:
            if self._tensorboard is not None:
                self._tensorboard.close(text)
        finally:
            if self._metrics is not None:
                self._metrics.close()

    def _sample_capacity(self, a: Snapshot, b: Snapshot) -> None:
        rate = unthrottled_producer_rate(self.figures(a, b), a.queue_batches)
        if rate is not None and not rate <= self.capacity_per_s:  # NaN: first sample
            self.capacity_per_s = rate

    @property
    def _planned(self) -> int:
        return self._facts.steps_planned if self._facts is not None else 0


def received_rate(end: Snapshot) -> float:
    """MiB/s received over the time batches were received (``LedgerSnapshot.receiving_s``), every
    batch up to snapshot ``end``; NaN when that time is 0 (no batch, or one)."""
    seconds = end.books.receiving_s
    if not seconds > 0:
        return math.nan
    return end.books.totals.received_bytes / MIB / seconds


def unthrottled_producer_rate(f: Figures, queue_at_start: int) -> float | None:
    """Batches/s one producer delivered in window ``f``, if nothing held the producers back.

    Only a window in which the queue never filled (not at its start, at no step, not at its
    end) shows what producers can deliver; behind a full queue they deliver what the step takes.
    None for other windows and for windows without deliveries.
    """
    full = max(queue_at_start, f.queue_batches) >= f.queue_capacity or (
        f.steps > 0 and f.queue_full_pct > 0
    )
    if full or not f.producers_active:
        return None
    return f.deliver_per_s / f.producers_active
