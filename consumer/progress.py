"""Live progress: a rewritten line on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from common.stats import percentile
from consumer.trainer import StepRecord, Trainer

log = logging.getLogger("stagefeed.progress")


class Progress:
    """A ``StepObserver`` that reports every ``interval_s`` seconds over the steps since then."""

    def __init__(self, interval_s: float = 5.0, stream: TextIO | None = None) -> None:
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._window: list[StepRecord] = []
        self._last = time.monotonic()
        self._last_bytes = 0

    def on_step(self, record: StepRecord, trainer: Trainer) -> None:
        self._window.append(record)
        now = time.monotonic()
        if now - self._last < (0.5 if self.tty else self.interval_s):
            return
        line = self.line(trainer, now)
        self._window.clear()
        self._last = now
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            self.stream.flush()
        else:
            log.info("%s", line)

    def line(self, trainer: Trainer, now: float) -> str:
        window = self._window
        totals = trainer.ledger.totals()
        elapsed = max(now - self._last, 1e-9)
        mib_s = (totals["received_bytes"] - self._last_bytes) / 2**20 / elapsed
        self._last_bytes = totals["received_bytes"]
        ms = percentile([(r.wait_s + r.step_s) * 1000 for r in window], 50)
        busy = sum(r.wait_s + r.step_s for r in window)
        stall = 100.0 * sum(r.wait_s for r in window) / busy if busy else 0.0
        images = len(window) * trainer.options.spec.batch_size / elapsed
        steps = trainer.options.steps + trainer.options.warmup_steps
        return (
            f"step {window[-1].step}/{steps if trainer.options.steps else '-'}  "
            f"{ms:.0f} ms/step  {images:.0f} img/s  stall {stall:.0f}%  "
            f"queue {trainer.queue_batches}/{trainer.options.queue_capacity}  "
            f"{mib_s:.0f} MiB/s in  producers {trainer.ledger.producer_count()}  "
            f"dropped {totals['dropped']}"
        )

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
