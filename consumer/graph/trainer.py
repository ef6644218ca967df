"""The graph-mode trainer: intake + feeding graph + the train loop that measures its own stalls.

Step records and observers are ``consumer.run_facts``' (shared with the Keras trainer; public
as ``stagefeed.StepRecord`` and ``stagefeed.StepObserver``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from stagefeed.common.errors import ClosedError, ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.tf_config import ClusterPlace
from stagefeed.consumer import model_ref
from stagefeed.consumer.checkpoints import Checkpoints, resume_point
from stagefeed.consumer.devices import training_device
from stagefeed.consumer.graph import feed_graph
from stagefeed.consumer.graph.saver import saver_format
from stagefeed.consumer.intake.intake import Intake
from stagefeed.consumer.memory import malloc_policy
from stagefeed.consumer.run_end import Ending, RunEnd
from stagefeed.consumer.run_facts import StepObserver, StepRecord
from stagefeed.consumer.trainer_base import TrainerBase
from stagefeed.consumer.wait_line import WaitLine

log = logging.getLogger(__name__)
v1 = tf.compat.v1

WAIT_SLICE_S = 0.1


class Trainer(TrainerBase):
    """Graph mode: owns the TF session, the intake and the books.

    Lifecycle: ``start()`` (build, bind, start threads) -> ``train(stop)`` -> ``close()``
    (idempotent; closes the queue so blocked enqueues return, joins threads, closes session).
    ``session`` is the user's between ``start()`` and ``close()``: to restore or save
    variables (``tf.compat.v1.train.Saver``), or to run their own loop. With
    ``options.save_dir``, ``train`` checkpoints and saves itself (``consumer.checkpoints``).
    ``device``, ``facts`` and ``reader`` exist from construction on (``ConfigError`` if the
    device is missing).
    """

    def __init__(
        self,
        options: TrainerOptions,
        observers: Sequence[StepObserver] = (),
        configure_server: Callable[[Any], None] | None = None,
        model_fn: feed_graph.ModelFn | None = None,
        *,
        place: ClusterPlace | None = None,
    ) -> None:
        device = training_device(options.device)
        super().__init__(options, observers, configure_server, device=device, place=place)
        # What a step does with the staged batch: given, or ``options.model`` (resolved at start).
        self.model_fn = model_fn
        self.consumed = 0  # dequeues issued: primed puts + steps
        self.feed: feed_graph.FeedGraph | None = None
        self.session: Any = None
        self.checkpoints: Checkpoints | None = None
        self._closed = False

    def start(self) -> Trainer:
        options = self.options
        if options.keep_freed_memory:
            malloc_policy.keep_freed_memory(options.schema.largest_array_bytes)
        model_fn, ref = self.model_fn, options.model
        if model_fn is None:
            kind, model_fn = model_ref.resolve(ref)
            if kind != model_ref.GRAPH:
                raise ConfigError(f"--model {ref!r} builds a Keras model, not a graph model_fn")
        self.feed = model_ref.building(
            ref, feed_graph.build, self.schema, options.queue_capacity, options.stage_depth,
            self.device, model_fn,
        )  # fmt: skip
        config = feed_graph.session_config(self.device)
        self.session = v1.Session(graph=self.feed.graph, config=config)
        with self.feed.graph.as_default():
            self.session.run(v1.global_variables_initializer())
        if options.save_dir is not None:
            model = saver_format(self.session, options.save_dir)
            resumed = resume_point(options, model, self.place.chief)  # restored into the model
            books = self.resume_books(resumed)
            self.checkpoints = Checkpoints(
                options, model, self.place.chief, resumed=resumed, position=books.position,
                on_saved=books.saved,
            )  # fmt: skip
        self._intake = Intake(
            options,
            self.schema,
            self.feed.enqueuer(self.session),
            self.ledger,
            self._configure_server,
            place=self.place,
        ).start()
        self.endpoint = self._intake.endpoint
        return self

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

        Runs ``steps_planned`` steps (0: until stopped or the data ended), and no step past
        the planned passes of a source with passes. Each step's
        ``StepRecord`` goes to the observers (none is kept here); raises ``ClosedError`` only if
        stopped before priming ended, and ``NonFiniteLoss`` at a non-finite loss under
        ``on_nan="stop"`` (nothing is saved then).
        """
        feed = self.feed
        assert feed is not None and self._intake is not None
        checks = [self._intake.check] + ([health_check] if health_check else [])
        run_end = RunEnd(stop, self._intake.data_ended, checks)
        for _ in range(self.options.stage_depth):
            if not self._wait_for_batch(run_end):
                break
            self.session.run(feed.put)
            self.consumed += 1
        log.info("staging area primed with %d batches", self.consumed)
        warmup = self.options.warmup_steps
        base = step = self.resumed_from or 0  # a resumed run's steps go on from its checkpoint
        # The run's steps (``steps_planned``: its passes decide once a source with passes
        # joined a run without --steps), and no step past its planned passes.
        while not (0 < self.steps_planned <= step or self.passes_done()):
            verdict = run_end.poll()  # also while batches flow: a failure or stop ends the run
            if verdict.ending is Ending.FAIL:
                assert verdict.failure is not None
                raise verdict.failure
            if verdict.ending is Ending.STOP:
                break
            if verdict.failure is not None:  # a source failed: only what was sent is trained
                self._intake.stop_granting()
            queued = self.queue_batches
            started = time.monotonic()
            try:
                more = self._wait_for_batch(run_end)
            except ClosedError:
                break
            if not more and self.consumed == step - base:  # every dequeued batch trained
                self.passes_ended(step - base)  # a pass end booked after its last step
                self.data_ended = run_end.verdict.data_ended
                self.drained_because = run_end.verdict.reason
                log.info("%s and every batch was trained", run_end.verdict.reason)
                break
            ready = time.monotonic()
            # At the end of data, the staged batches are trained without a put behind them.
            op = feed.step if more else feed.train_only
            fetches = [feed.loss, feed.trained_peer, feed.trained_seq, op]
            try:
                loss, peer, seq, _ = self.session.run(fetches)
            except tf.errors.OpError as exc:  # the model's step: the run fails, summary first
                log.debug("the train step raised", exc_info=True)
                raise model_ref.step_failed(self.options.model, exc) from None
            done = time.monotonic()
            self.consumed += more
            step += 1
            self.ledger.trained([peer], [seq])
            self.book_step(StepRecord(
                step, step > warmup, ready - started, done - ready, float(loss), queued, done
            ))  # fmt: skip
            self.epoch_ended(step)
            self.passes_ended(step - base)
            if self.checkpoints is not None:
                self.checkpoints.after_step(step)
        if run_end.verdict.failure is not None:  # drained after a source's failure: now fail
            raise run_end.verdict.failure
        if self.checkpoints is not None:
            self.checkpoints.final(step, self.finished(step))

    def _wait_for_batch(self, run_end: RunEnd) -> bool:
        """True once a batch is queued; False when the run drains with none left to queue.
        ``ClosedError`` on a stop request; a failure is raised as it came (``RunEnd``)."""
        need = self.consumed + 1
        line = WaitLine(self.options.wait_log_s, self.ledger.producer_count, self.endpoint)
        line.waiting()
        assert self._intake is not None
        while not self._intake.availability.wait_for(need, WAIT_SLICE_S):
            verdict = run_end.poll()
            if verdict.ending is Ending.FAIL:
                assert verdict.failure is not None
                raise verdict.failure
            if verdict.ending is Ending.STOP:
                raise ClosedError("stop requested while waiting for data")
            if verdict.ending is Ending.DRAIN and self._intake.availability.enqueued < need:
                return False
            line.waiting()
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

