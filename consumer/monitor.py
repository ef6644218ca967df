"""The trainer's one step observer: counts, shows progress, advises, and feeds the exporters.

Per step (on the train loop) the ``Monitor`` adds the ``StepRecord`` to Python counters and, for
TensorBoard, appends it to a bounded deque: no TF call, no ledger read. When a progress line,
an advice line or a capacity sample is due it takes one ``Snapshot`` and works on windows of
snapshots. The Prometheus endpoint and the TensorBoard writer run on their own named threads
and read snapshots themselves.

Lifecycle: ``Monitor(options)`` -> ``start(trainer)`` (binds the metrics port, opens the
logdir; ``ConfigError`` if either fails) -> ``on_step`` ... -> ``close()`` (idempotent: ends the
progress line, computes ``final``, writes and closes TensorBoard, stops the HTTP server).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

from stagefeed.common.endpoints import host_problem
from stagefeed.common.errors import ConfigError
from stagefeed.consumer.advice import DEFAULT_WIRE_MB_S, Advice, advise
from stagefeed.consumer.figures import (
    Figures,
    Snapshot,
    StepCounters,
    empty_snapshot,
    figures_between,
    take_snapshot,
)
from stagefeed.consumer.progress import Progress

if TYPE_CHECKING:
    from stagefeed.consumer.trainer import StepRecord, Trainer

log = logging.getLogger("stagefeed.monitor")

# Producer capacity is sampled over windows at least this long.
CAPACITY_WINDOW_S = 1.0


@dataclasses.dataclass(frozen=True)
class ObserveOptions:
    """What to show and export. A bad value raises ``ConfigError`` naming it."""

    progress_s: float = 5.0  # seconds between progress log lines (terminal: 0.5 s)
    logdir: str | None = None  # TensorBoard event files go here
    metrics_port: int | None = None  # Prometheus endpoint; 0 picks a free port
    # Loopback unless told: producer ids and the trainer's figures are not for every network.
    metrics_bind: str = "127.0.0.1"
    metrics_producer_labels: bool = False  # per-producer series, labelled with producer ids
    advice_s: float = 300.0  # seconds between advice lines during a run
    wire_mb_s: float = DEFAULT_WIRE_MB_S  # what the producers' link carries (advice only)
    tensorboard_s: float = 2.0  # seconds between TensorBoard flushes

    def __post_init__(self) -> None:
        for name in ("progress_s", "advice_s", "wire_mb_s", "tensorboard_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        port = self.metrics_port
        if port is not None and (not isinstance(port, int) or not 0 <= port <= 65535):
            raise ConfigError(f"metrics_port must be in [0, 65535], got {port!r}")
        if self.logdir is not None and not self.logdir.strip():
            raise ConfigError(f"logdir must name a directory, got {self.logdir!r}")
        why = host_problem(self.metrics_bind, wildcard_ok=False)
        if why:
            raise ConfigError(f"metrics_bind {self.metrics_bind!r}: {why}")


class Monitor:
    """A ``StepObserver``; see the module docstring for what runs where."""

    def __init__(self, options: ObserveOptions, stream: Any = None) -> None:
        self.options = options
        self.progress = Progress(options.progress_s, stream)
        self.final: dict[str, Any] = {}  # {"advice", "bottleneck"} once closed
        self.metrics_address = ""  # host:port of the Prometheus endpoint once started
        self.capacity_per_s = math.nan  # best unthrottled batches/s of one producer
        self._trainer: Trainer | None = None
        self._counters = StepCounters(1)
        self._origin = self._shown = self._advised = self._sampled = empty_snapshot()
        # When each was last done, on the step records' clock (time.monotonic()).
        self._shown_at = self._advised_at = self._sampled_at = self._origin.at
        self._final_base: Snapshot | None = None
        self._metrics: Any = None
        self._tensorboard: Any = None
        self._closed = False

    def start(self, trainer: Trainer) -> Monitor:
        self._trainer = trainer
        self._counters = StepCounters(trainer.options.queue_capacity)
        self._origin = self._shown = self._advised = self._sampled = empty_snapshot()
        self._shown_at = self._advised_at = self._sampled_at = self._origin.at
        opts = self.options
        if opts.metrics_port is not None:
            try:
                from stagefeed.consumer.metrics_http import MetricsServer
            except ImportError as exc:
                raise ConfigError(
                    f"--metrics-port needs prometheus-client ({exc}); "
                    "install it with pip install 'stagefeed[metrics]'"
                ) from None
            self._metrics = MetricsServer(
                self.snapshot,
                trainer,
                opts.metrics_bind,
                opts.metrics_port,
                producer_labels=opts.metrics_producer_labels,
            ).start()
            self.metrics_address = self._metrics.address
        if opts.logdir is not None:
            from stagefeed.consumer.tensorboard import TensorBoardWriter

            self._tensorboard = TensorBoardWriter(
                opts.logdir, self.snapshot, self.figures, opts.tensorboard_s
            ).start()
        return self

    def snapshot(self) -> Snapshot:
        assert self._trainer is not None, "Monitor.start(trainer) first"
        return take_snapshot(self._counters, self._trainer)

    def figures(self, a: Snapshot, b: Snapshot) -> Figures:
        """The window from ``a`` to ``b``, with the producer capacity seen so far."""
        assert self._trainer is not None, "Monitor.start(trainer) first"
        spec = self._trainer.options.schema
        f = figures_between(
            a, b, spec.batch_size, spec.batch_bytes, spec.wire_dtype, self._counters.queue_capacity
        )
        return dataclasses.replace(f, producer_capacity_per_s=self.capacity_per_s)

    def advice(self, f: Figures) -> Advice:
        return advise(f, self.options.wire_mb_s)

    def on_step(self, record: StepRecord, trainer: Trainer) -> None:
        self._counters.add(record)
        if self._tensorboard is not None:
            self._tensorboard.record(record)
        now = record.at
        is_base = not record.timed or record.step == 1
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
            self.progress.show(self.figures(self._shown, snap), self._steps_planned())
            self._shown, self._shown_at = snap, now
        if advise_now:
            self.progress.break_line()
            log.info("advice: %s", self.advice(self.figures(self._advised, snap)).text)
            self._advised, self._advised_at = snap, now

    def final_figures(self) -> Figures:
        """The run's figures: after the warm-up if steps followed it, else from the start."""
        end = self.snapshot()
        base = self._final_base
        if base is None or end.steps.steps <= base.steps.steps:
            base = self._origin
        return self.figures(base, end)

    def close(self) -> None:
        """Idempotent. Sets ``final`` (once started); stops the exporters' threads."""
        if self._closed:
            return
        self._closed = True
        if self._trainer is not None and self._counters.read().steps > self._shown.steps.steps:
            # The last steps since the last line: the line ends on the final step count.
            self.progress.show(self.figures(self._shown, self.snapshot()), self._steps_planned())
        self.progress.finish()
        text = None
        if self._trainer is not None:
            advice = self.advice(self.final_figures())
            self.final = {"advice": advice.text, "bottleneck": advice.kind}
            text = advice.text
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

    def _steps_planned(self) -> int:
        assert self._trainer is not None
        return self._trainer.options.total_steps


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
