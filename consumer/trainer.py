"""The trainer: receive pool + feeding graph + the train loop that measures its own stalls."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import tensorflow as tf
from stagefeed.common.errors import ClosedError
from stagefeed.common.ledger import Ledger
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer import graph as feed_graph
from stagefeed.consumer import malloc_policy
from stagefeed.consumer.receiver import Availability, ReceivePool

log = logging.getLogger(__name__)
v1 = tf.compat.v1

WAIT_SLICE_S = 0.1


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One train step. ``wait_s``: time the step waited for a batch before it could run."""

    step: int  # 1-based, warm-up steps included
    timed: bool  # False for warm-up steps
    wait_s: float
    step_s: float
    loss: float
    queue_batches: int  # batches in the FIFOQueue when the step started
    at: float  # time.monotonic() at the end of the step


class StepObserver(Protocol):
    def on_step(self, record: StepRecord, trainer: Trainer) -> None: ...


class Trainer:
    """Owns the TF session, the receive pool and the books.

    Lifecycle: ``start()`` (build, bind, start threads) -> ``train(stop)`` -> ``close()``
    (idempotent; closes the queue so blocked enqueues return, joins threads, closes session).
    """

    def __init__(
        self,
        options: TrainerOptions,
        observers: Sequence[StepObserver] = (),
        configure_server: Callable[[Any], None] | None = None,
        step_builder: feed_graph.StepBuilder = feed_graph.alexnet_step,
    ) -> None:
        self.options = options
        self.step_builder = step_builder  # what a step does with the staged batch
        self.observers = list(observers)
        self.ledger = Ledger()
        self.availability = Availability()
        self.consumed = 0  # dequeues issued: primed puts + steps
        self.records: list[StepRecord] = []
        self.device = ""
        self.endpoint = ""
        self._configure_server = configure_server
        self._feed: feed_graph.FeedGraph | None = None
        self._session: Any = None
        self._receiver: ReceivePool | None = None
        self._closed = False

    def start(self) -> Trainer:
        options = self.options
        if options.keep_freed_memory:
            malloc_policy.keep_freed_memory()
        self.device = feed_graph.pick_device(options.device)
        self._feed = feed_graph.build(
            options.spec,
            options.queue_capacity,
            options.stage_depth,
            self.device,
            self.step_builder,
        )
        self._session = v1.Session(
            graph=self._feed.graph, config=feed_graph.session_config(self.device)
        )
        with self._feed.graph.as_default():
            self._session.run(v1.global_variables_initializer())
        self._receiver = ReceivePool(
            options,
            self._feed,
            self._session,
            self.ledger,
            self.availability,
            self._configure_server,
        ).start()
        self.endpoint = self._receiver.endpoint
        return self

    @property
    def queue_batches(self) -> int:
        """Batches in the FIFOQueue (lower bound; no TF call)."""
        return max(0, self.availability.enqueued - self.consumed)

    def train(
        self, stop: threading.Event, health_check: Callable[[], None] | None = None
    ) -> list[StepRecord]:
        """Prime the staging area, then run warm-up and timed steps until done or ``stop``.

        Returns the step records; raises ``ClosedError`` only if stopped before priming ended.
        """
        feed = self._feed
        assert feed is not None and self._receiver is not None
        checks = [self._receiver.check] + ([health_check] if health_check else [])
        for _ in range(self.options.stage_depth):
            self._wait_for_batch(stop, checks)
            self._session.run(feed.put)
            self.consumed += 1
        log.info("staging area primed with %d batches", self.options.stage_depth)
        warmup, steps = self.options.warmup_steps, self.options.steps
        step = 0
        while not stop.is_set() and (steps == 0 or step < warmup + steps):
            queued = self.queue_batches
            started = time.monotonic()
            try:
                self._wait_for_batch(stop, checks)
            except ClosedError:
                break
            ready = time.monotonic()
            loss, producer, seq, _ = self._session.run(
                [feed.loss, feed.trained_producer, feed.trained_seq, feed.step]
            )
            done = time.monotonic()
            self.consumed += 1
            step += 1
            self.ledger.trained([producer], [seq])
            record = StepRecord(
                step, step > warmup, ready - started, done - ready, float(loss), queued, done
            )
            self.records.append(record)
            if not math.isfinite(record.loss):
                log.warning("step %d: loss is %s", step, record.loss)
            for observer in self.observers:
                observer.on_step(record, self)
        return self.records

    def _wait_for_batch(self, stop: threading.Event, checks: list[Callable[[], None]]) -> None:
        need = self.consumed + 1
        began = last_said = time.monotonic()
        while not self.availability.wait_for(need, WAIT_SLICE_S):
            if stop.is_set():
                raise ClosedError("stop requested while waiting for data")
            for check in checks:
                check()
            now = time.monotonic()
            if now - last_said >= self.options.wait_log_s:
                last_said = now
                log.info(
                    "waiting for data for %.0f s (%d producers seen, listening on %s)",
                    now - began,
                    self.ledger.producer_count(),
                    self.endpoint,
                )

    def close(self) -> None:
        """Idempotent: close the queue (unblocks enqueues), stop threads, close the session."""
        if self._closed:
            return
        self._closed = True
        if self._session is not None and self._feed is not None:
            try:
                self._session.run(self._feed.close_queue)
            except tf.errors.OpError as exc:
                log.warning("closing the queue failed: %s", exc)
        if self._receiver is not None:
            self._receiver.close()
        if self._session is not None:
            self._session.close()

    def __enter__(self) -> Trainer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
