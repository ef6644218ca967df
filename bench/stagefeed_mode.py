"""The stagefeed mode of ``bench steps``: the real trainer fed by real producer processes.

``consumer.graph.trainer.Trainer`` (intake, FIFOQueue, StagingArea,
``consumer.graph.alexnet.model_fn``) and
``producer.pool.Producers`` run as in ``stagefeed run``; nothing is reimplemented. The
trainer's loop runs on its own thread ("bench-stagefeed-train") and a gate observer holds it
after every step until ``step()`` asks for the next one, so steps run only when this mode is
being timed. A step's time is the trainer's own: wait for a batch + ``session.run``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from stagefeed.bench.config import StepsConfig
from stagefeed.bench.feed_path import Loopback
from stagefeed.common.errors import BrokenError, ClosedError
from stagefeed.common.lifecycle import join_threads
from stagefeed.consumer.graph import alexnet
from stagefeed.consumer.graph.trainer import Trainer
from stagefeed.consumer.run_facts import StepRecord
from stagefeed.producer.pool import pool_check

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 600.0
SETTLE_TIMEOUT_S = 60.0
POLL_S = 0.02
GATE_POLL_S = 0.1
JOIN_TIMEOUT_S = 10.0
STAGE_DEPTH = 2


class StagefeedMode:
    """Invariant: at most one trainer step runs per ``step()`` call (the gate's semaphore)."""

    name = "stagefeed"

    def __init__(self, config: StepsConfig, device: str) -> None:
        self.config = config
        self.device = device
        self._stop = threading.Event()
        self._go = threading.Semaphore(0)
        self._records: queue.Queue[StepRecord | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.link = Loopback(config)
        self.trainer: Trainer | None = None

    def setup(self) -> dict[str, Any]:
        config, link = self.config, self.link
        options = link.trainer_options(
            STAGE_DEPTH,
            self.device,
            steps=0,  # until stopped: the gate decides how many steps run
            warmup_steps=0,  # the coordinator's warm-up steps are this mode's first steps
        )
        self.trainer = Trainer(options, [self], model_fn=alexnet.model_fn).start()
        link.start_producers(self.trainer.endpoint)
        self._thread = threading.Thread(target=self._train, name="bench-stagefeed-train")
        self._thread.start()
        self._next_record(START_TIMEOUT_S)  # priming + one untimed step
        settled = self.settle()
        return {
            "endpoint": self.trainer.endpoint,
            "producers": config.producers,
            "enqueue_threads": config.enqueue_threads,
            "queue_capacity": options.queue_capacity,
            "stage_depth": STAGE_DEPTH,
            "queue_full_at_start": settled["queue_full"],
        }

    def on_step(self, record: StepRecord) -> None:
        """The gate (a ``StepObserver``): hand the record over, hold until the next ``step()``."""
        self._records.put(record)
        while not self._go.acquire(timeout=GATE_POLL_S):
            if self._stop.is_set():
                return

    def step(self) -> tuple[float, float | None]:
        self._go.release()
        record = self._next_record(STEP_TIMEOUT_S)
        return record.wait_s + record.step_s, record.wait_s

    def settle(self) -> dict[str, Any]:
        """Wait until the intake has refilled the queue (producers kept up)."""
        assert self.trainer is not None
        capacity = self.trainer.options.queue_capacity
        started = time.monotonic()
        while self.trainer.queue_batches < capacity:
            self._check()
            if time.monotonic() - started > SETTLE_TIMEOUT_S:
                break
            time.sleep(POLL_S)
        return {
            "queue_full": self.trainer.queue_batches >= capacity,
            "settle_s": round(time.monotonic() - started, 3),
        }

    def close(self) -> None:
        self._stop.set()
        self._go.release()
        if self._thread is not None:
            join_threads([self._thread], JOIN_TIMEOUT_S)
        self.link.close()  # the producers first: the trainer's queue stays open meanwhile
        if self.trainer is not None:
            self.trainer.close()

    def feed_cpu_s(self) -> float | None:
        """``Loopback.feed_cpu_s``: producers, ZeroMQ I/O, intake, enqueue and pool threads."""
        return self.link.feed_cpu_s()

    def _train(self) -> None:
        assert self.trainer is not None
        assert self.link.pool is not None
        try:
            self.trainer.train(self._stop, health_check=pool_check(self.link.pool))
        except ClosedError:
            pass  # stopped by close()
        except Exception as exc:  # noqa: BLE001 - handed to step(), never swallowed
            log.exception("stagefeed train thread failed")
            self._failure = exc
        finally:
            self._records.put(None)

    def _check(self) -> None:
        if self._failure is not None:
            raise BrokenError(f"stagefeed trainer failed: {self._failure!r}") from self._failure

    def _next_record(self, timeout_s: float) -> StepRecord:
        try:
            record = self._records.get(timeout=timeout_s)
        except queue.Empty:
            raise BrokenError(f"no trainer step within {timeout_s:.0f} s") from None
        if record is None:
            self._check()
            raise BrokenError("the stagefeed trainer stopped")
        return record
