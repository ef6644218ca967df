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
from stagefeed.common.errors import ClosedError, ConfigError
from stagefeed.common.ledger import Ledger
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer import graph as feed_graph
from stagefeed.consumer import malloc_policy, models
from stagefeed.consumer.figures import RunFacts, RunReader
from stagefeed.consumer.intake import Intake

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
    """Told of each step on the train loop (keep it short). Observers that need more than the
    record are given the trainer's ``facts`` and ``reader``, never the trainer."""

    def on_step(self, record: StepRecord) -> None: ...


class Trainer:
    """Graph mode: owns the TF session, the intake and the books.

    Lifecycle: ``start()`` (build, bind, start threads) -> ``train(stop)`` -> ``close()``
    (idempotent; closes the queue so blocked enqueues return, joins threads, closes session).
    ``session`` is the user's between ``start()`` and ``close()``: to restore or save
    variables (``tf.compat.v1.train.Saver``), or to run their own loop. ``device``, ``facts``
    and ``reader`` exist from construction on (``ConfigError`` if the device is missing).
    """

    def __init__(
        self,
        options: TrainerOptions,
        observers: Sequence[StepObserver] = (),
        configure_server: Callable[[Any], None] | None = None,
        model_fn: feed_graph.ModelFn | None = None,
    ) -> None:
        self.options = options
        self.schema = options.schema
        # What a step does with the staged batch: given, or ``options.model`` (resolved at start).
        self.model_fn = model_fn
        self.observers = list(observers)
        self.ledger = Ledger()
        self.consumed = 0  # dequeues issued: primed puts + steps
        self.steps_done = 0
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.loss_finite = True
        self.data_ended = False  # every producer signalled end of data, all of it trained
        self.device = feed_graph.pick_device(options.device)
        self.facts = RunFacts(
            device=self.device,
            batch_size=self.schema.batch_size,
            batch_bytes=self.schema.batch_bytes,
            wire_dtype=self.schema.wire_dtype,
            queue_capacity=options.queue_capacity,
            steps_planned=options.steps + options.warmup_steps if options.steps else 0,
        )
        self.reader = RunReader(queue_batches=lambda: self.queue_batches, books=self.ledger.read)
        self.endpoint = ""
        self._configure_server = configure_server
        self.feed: feed_graph.FeedGraph | None = None
        self.session: Any = None
        self._intake: Intake | None = None
        self._closed = False

    def start(self) -> Trainer:
        options = self.options
        if options.keep_freed_memory:
            malloc_policy.keep_freed_memory()
        model_fn, ref = self.model_fn, options.model
        if model_fn is None:
            kind, model_fn = models.resolve(ref)
            if kind != models.GRAPH:
                raise ConfigError(f"--model {ref!r} builds a Keras model, not a graph model_fn")
        self.feed = models.building(
            ref, feed_graph.build, self.schema, options.queue_capacity, options.stage_depth,
            self.device, model_fn,
        )  # fmt: skip
        config = feed_graph.session_config(self.device)
        self.session = v1.Session(graph=self.feed.graph, config=config)
        with self.feed.graph.as_default():
            self.session.run(v1.global_variables_initializer())
        self._intake = Intake(
            options,
            self.schema,
            self.feed.enqueuer(self.session),
            self.ledger,
            self._configure_server,
        ).start()
        self.endpoint = self._intake.endpoint
        return self

    @property
    def transport(self) -> str:
        """How batches reach this trainer: ``tcp``/``ipc`` (ZeroMQ), or ``shm+tcp``/``shm+ipc``
        when it also maps producers' shared-memory pools (control over the ZeroMQ one)."""
        scheme = self.endpoint.split("://", 1)[0] or "tcp"
        shm = self._intake.shm if self._intake is not None else None
        return scheme if shm is None else f"shm+{scheme}"

    def shm_stats(self) -> dict[str, Any] | None:
        """The pools' socket, sizing and counts (``consumer.shm_gate``); None without shm."""
        shm = self._intake.shm if self._intake is not None else None
        return None if shm is None else shm.stats()

    @property
    def queue_batches(self) -> int:
        """Batches in the FIFOQueue (lower bound; no TF call)."""
        if self._intake is None:
            return 0
        return max(0, self._intake.availability.enqueued - self.consumed)

    def train(
        self, stop: threading.Event, health_check: Callable[[], None] | None = None
    ) -> None:
        """Prime the staging area, then run warm-up and timed steps until done or ``stop``.

        Each step's ``StepRecord`` goes to the observers (none is kept here); raises
        ``ClosedError`` only if stopped before priming ended.
        """
        feed = self.feed
        assert feed is not None and self._intake is not None
        checks = [self._intake.check] + ([health_check] if health_check else [])
        for _ in range(self.options.stage_depth):
            if not self._wait_for_batch(stop, checks):
                break
            self.session.run(feed.put)
            self.consumed += 1
        log.info("staging area primed with %d batches", self.consumed)
        warmup, steps = self.options.warmup_steps, self.options.steps
        step = 0
        while not stop.is_set() and (steps == 0 or step < warmup + steps):
            queued = self.queue_batches
            started = time.monotonic()
            try:
                more = self._wait_for_batch(stop, checks)
            except ClosedError:
                break
            if not more and self.consumed == self.steps_done:
                self.data_ended = True
                log.info("every producer's data ended and every batch was trained")
                break
            ready = time.monotonic()
            # At the end of data, the staged batches are trained without a put behind them.
            op = feed.step if more else feed.train_only
            fetches = [feed.loss, feed.trained_peer, feed.trained_seq, op]
            loss, peer, seq, _ = self.session.run(fetches)
            done = time.monotonic()
            self.consumed += more
            step += 1
            self.steps_done = step
            self.ledger.trained([peer], [seq])
            record = StepRecord(
                step, step > warmup, ready - started, done - ready, float(loss), queued, done
            )
            if self.loss_first is None:
                self.loss_first = record.loss
            self.loss_last = record.loss
            if not math.isfinite(record.loss):
                self.loss_finite = False
                log.warning("step %d: loss is %s", step, record.loss)
            for observer in self.observers:
                observer.on_step(record)

    def _wait_for_batch(self, stop: threading.Event, checks: list[Callable[[], None]]) -> bool:
        """True once a batch is queued; False when the data ended with none left to queue."""
        need = self.consumed + 1
        began = last_said = time.monotonic()
        assert self._intake is not None
        while not self._intake.availability.wait_for(need, WAIT_SLICE_S):
            if stop.is_set():
                raise ClosedError("stop requested while waiting for data")
            if self._intake.data_ended() and self._intake.availability.enqueued < need:
                return False
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
        return True

    def close(self) -> None:
        """Idempotent: close the queue (unblocks enqueues), stop threads, close the session."""
        if self._closed:
            return
        self._closed = True
        if self._intake is not None:
            self._intake.stop_granting()
        if self.session is not None and self.feed is not None:
            try:
                self.session.run(self.feed.close_queue)
            except tf.errors.OpError as exc:
                log.warning("closing the queue failed: %s", exc)
        if self._intake is not None:
            self._intake.close()
        if self.session is not None:
            self.session.close()

    def __enter__(self) -> Trainer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
