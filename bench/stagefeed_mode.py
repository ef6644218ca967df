"""The stagefeed mode of ``bench steps``: the real trainer fed by real producer processes.

``consumer.trainer.Trainer`` (intake, FIFOQueue, StagingArea, ``consumer.model.model_fn``) and
``producer.pool.ProducerPool`` run as in ``stagefeed run``; nothing is reimplemented. The
trainer's loop runs on its own thread ("bench-stagefeed-train") and a gate observer holds it
after every step until ``step()`` asks for the next one, so steps run only when this mode is
being timed. A step's time is the trainer's own: wait for a batch + ``session.run``.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from typing import Any

from stagefeed.bench.config import StepsConfig
from stagefeed.bench.cpu import process_cpu_s, sum_cpu_s, threads_cpu_s
from stagefeed.common.errors import BrokenError, ClosedError
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import ProducerOptions, TrainerOptions
from stagefeed.consumer import model
from stagefeed.consumer.trainer import StepRecord, Trainer
from stagefeed.producer.pool import ProducerPool, pool_check

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 600.0
SETTLE_TIMEOUT_S = 60.0
POLL_S = 0.02
GATE_POLL_S = 0.1
JOIN_TIMEOUT_S = 10.0
STAGE_DEPTH = 2
# Each producer may hold this many batches unsent (bounds its memory: one more for filling).
PRODUCER_UNSENT_BATCHES = 4


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
        self._ipc_path: str | None = None
        self.trainer: Trainer | None = None
        self.pool: ProducerPool | None = None

    def setup(self) -> dict[str, Any]:
        config, schema = self.config, self.config.schema
        shared = config.transport == "shm"  # batches in pool slots, control over ipc
        if config.transport in ("ipc", "shm"):
            self._ipc_path = os.path.join(tempfile.gettempdir(), f"stagefeed-bench-{os.getpid()}")
            bind = f"ipc://{self._ipc_path}"
        else:
            bind = "tcp://127.0.0.1:*"
        options = TrainerOptions(
            bind=bind,
            schema=schema,
            recv_threads=config.recv_threads,
            steps=0,  # until stopped: the gate decides how many steps run
            warmup_steps=0,  # the coordinator's warm-up steps are this mode's first steps
            queue_mb=config.queue_capacity * schema.batch_bytes / 2**20,
            stage_depth=STAGE_DEPTH,
            device="gpu" if self.device.startswith("/gpu") else "cpu",
            transport="shm" if shared else "zmq",
            shm_socket=f"{self._ipc_path}-shm/pools.sock" if shared else None,
            shm_producers=config.producers,
        )
        self.trainer = Trainer(options, [self], model_fn=model.model_fn).start()
        producer_options = ProducerOptions(
            connect=self.trainer.endpoint,
            workers=config.producers,
            schema=schema,
            inflight_mb=PRODUCER_UNSENT_BATCHES * schema.batch_bytes / 2**20,
            transport="shm" if shared else "zmq",
        )
        self.pool = ProducerPool(producer_options, logging.getLogger().level).start()
        self._thread = threading.Thread(target=self._train, name="bench-stagefeed-train")
        self._thread.start()
        self._next_record(START_TIMEOUT_S)  # priming + one untimed step
        settled = self.settle()
        return {
            "endpoint": self.trainer.endpoint,
            "producers": config.producers,
            "recv_threads": config.recv_threads,
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
        if self.pool is not None:
            self.pool.close()
        if self.trainer is not None:
            self.trainer.close()
        if self._ipc_path and os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)

    def feed_cpu_s(self) -> float | None:
        """CPU seconds so far of the feed path: producer processes, ZeroMQ I/O threads, the
        intake thread and the enqueue threads (the trainer's TF threads are not counted)."""
        assert self.pool is not None
        producers = [process_cpu_s(p.pid) for p in self.pool.processes]
        receive = threads_cpu_s(
            ("stagefeed-intake", "stagefeed-enqueue", "stagefeed-shm-pools"), ("ZMQbg/IO",)
        )
        return sum_cpu_s([*producers, receive])

    def _train(self) -> None:
        assert self.trainer is not None
        assert self.pool is not None
        try:
            self.trainer.train(self._stop, health_check=pool_check(self.pool))
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
