"""The Keras trainer: ``--model pkg.mod:build`` trained with ``model.fit`` on a ``ServedFeed``.

Same contract as the graph-mode ``Trainer`` (``consumer.trainer_base.TrainerBase``): the
launcher, the monitor and the summary cannot tell them apart.

Lifecycle: ``start()`` builds and checks the model (``consumer.keras_fit.model_check``: a bad one
is a ``ConfigError`` before the feed binds), restores it from the newest checkpoint of
``--save DIR`` when there is one (docs/resume.md), then binds the ``ServedFeed`` ->
``train(stop)`` runs ``fit`` for ``steps_planned`` steps (``epochs`` x
``steps_per_epoch``; 0: until stopped or the data ends; a resumed run: the steps left after its
checkpoint, ``consumer.keras_fit.resume_fit``), or the planned passes of a source with passes
-> ``close()`` (idempotent: the feed stops granting credit, its queue closes, the intake's
threads are joined).

With ``--save``, the feed's books hold the input position per shard: ``FeedCallback`` books the
batches each step trained (never the prefetched tail) and the checkpoint written after that
step reads them after its model (``consumer.checkpoints``), as graph mode does.

During ``fit``, callbacks on the training thread book each step (``FeedCallback``), turn it
into a ``StepRecord`` for the observers and the loss policy, and write checkpoints. A named
watcher thread, ``stagefeed-fit-watch``, does what a callback cannot while ``fit`` waits for
a batch: it acts on the run's ``RunEnd`` verdict (``consumer.run_end``, the graph trainer's
too). On a stop it stops ``fit`` (``FitStops``, the one writer of ``model.stop_training``,
with the stop's reason) and closes the queue (the waiting dequeue
returns, the dataset ends); on a failure it fails the run the same way and ``train`` raises
it; on a drain it closes the queue so the queued tail is trained and ``fit`` ends. While the
queue stays empty it says so every ``wait_log_s`` (``consumer.wait_line``). It is joined with
a timeout when ``fit`` returns.

Figures: a record's ``wait_s`` is the dequeue wait of the batches its step trained (the books'
``input_wait``, docs/tf2.md "The stall figure"), at most the time since the previous step;
``loss`` is what ``fit`` reports after the step, the epoch's running mean.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from stagefeed.common.errors import ConfigError, NonFiniteLoss
from stagefeed.common.lifecycle import join_threads
from stagefeed.common.options import TrainerOptions
from stagefeed.common.tf_config import ClusterPlace
from stagefeed.consumer import model_ref
from stagefeed.consumer.checkpoints import Checkpoints, ModelFormat, resume_point
from stagefeed.consumer.devices import training_device
from stagefeed.consumer.keras_fit.callback import FeedCallback
from stagefeed.consumer.keras_fit.fit_stops import FitStops
from stagefeed.consumer.keras_fit.model_check import check_model, check_step
from stagefeed.consumer.keras_fit.resume_fit import (
    PASS_EPOCH_STEPS,
    EpochCut,
    FitPlan,
    PassCut,
    fit_plan,
    keras_format,
    restore_iterations,
)
from stagefeed.consumer.run_end import Ending, RunEnd, Verdict
from stagefeed.consumer.run_facts import StepClock, StepObserver, StepRecord
from stagefeed.consumer.tf2.served_feed import ServedFeed
from stagefeed.consumer.trainer_base import TrainerBase
from stagefeed.consumer.wait_line import WaitLine

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0


class KerasTrainer(TrainerBase):
    """``model.fit`` on batches from producers; ``model`` is the user's after ``start()``."""

    def __init__(
        self,
        options: TrainerOptions,
        observers: Sequence[StepObserver] = (),
        configure_server: Callable[[Any], None] | None = None,
        build: Callable[[Any], Any] | None = None,
        *,
        place: ClusterPlace | None = None,
    ) -> None:
        super().__init__(
            options, observers, configure_server, device=training_device(options.device),
            place=place,
        )  # fmt: skip
        self.build = build
        self.model: keras.Model | None = None
        self.feed: ServedFeed | None = None
        self._dataset: Any = None
        self._queued = 0
        self._failure: BaseException | None = None
        self.checkpoints: Checkpoints | None = None
        self._closed = False
        # The step this run goes on from: 0, or a resumed run's checkpoint's (docs/resume.md).
        self.step_base = 0
        self.stops = FitStops()  # the one writer of model.stop_training (fit_stops)
        self._pass_cut: PassCut | None = None  # during a fit whose epochs are passes

    def start(self) -> KerasTrainer:
        if self.place.in_cluster:
            raise ConfigError(
                "TF_CONFIG names a cluster and Keras 3's fit cannot train under "
                "MultiWorkerMirroredStrategy (keras-team/keras#20585): use "
                "stagefeed.ClusterTrainer (what stagefeed train runs there)"
            )
        plan = self.build_and_bind()
        assert self.model is not None  # build_and_bind made it
        log.info(
            "Keras model %s: x %s, y %s; fit on %s",
            self.model.name, list(plan.inputs), list(plan.targets), self.device,
        )  # fmt: skip
        return self

    def build_and_bind(self, strategy: Any = None) -> Any:
        """Build and check the model (under ``strategy``'s scope, if given), then bind the
        ``ServedFeed`` and make its dataset (distributed by ``strategy``); the model plan."""
        options, ref = self.options, self.options.model
        build = self.build
        if build is None:
            kind, build = model_ref.resolve(ref)
            if kind != model_ref.KERAS:
                raise ConfigError(f"--model {ref!r} is a graph model_fn, not a Keras build")
        if strategy is None:
            model = model_ref.building(ref, build, self.schema)
        else:
            with strategy.scope():
                model = model_ref.building(ref, build, self.schema)
        plan = check_model(ref, model, self.schema, options.targets)
        self.model = model
        self.stops.bind(model)
        if options.save_dir is not None:
            self.checkpoints = self.book_positions(self.model_format(model))
        check_step(ref, model, plan, strategy)  # after the restore: the state fit would build
        self.feed = ServedFeed(options, self._configure_server, self.ledger, end_watch=False,
                               place=self.place)  # fmt: skip
        self._intake = self.feed.intake
        self.endpoint = self.feed.endpoint
        self._dataset = self.feed.dataset(
            plan.mapping(), strategy=strategy, cast="step", passes=False  # PassCut: one iterator
        )
        return plan

    def model_format(self, model: keras.Model) -> ModelFormat:
        """How ``Checkpoints`` saves and restores ``model`` (a ``.keras`` file)."""
        return keras_format(model)

    def book_positions(self, model_format: ModelFormat) -> Checkpoints:
        """With ``--save``: the checkpoint resumed restored into the model, the input position
        booked per shard from it, before the feed binds; the step counter and
        ``optimizer.iterations`` go on from its step. The run's ``Checkpoints``."""
        assert self.model is not None
        options, chief = self.options, self.place.chief
        resumed = resume_point(options, model_format, chief)
        books = self.resume_books(resumed)
        self.step_base = resumed.step if resumed is not None else 0
        if resumed is not None:
            restore_iterations(self.model, self.step_base)
        return Checkpoints(options, model_format, chief, resumed=resumed,
                           position=books.position, on_saved=books.saved)  # fmt: skip

    @property
    def queue_batches(self) -> int:
        """Batches in the feed's queue after the last step (no TF call)."""
        return self._queued

    def train(self, stop: threading.Event, health_check: Callable[[], None] | None = None) -> None:
        """``fit`` until the run's steps are done, ``stop`` is set or the data ended.

        Raises ``BrokenError`` if the intake or the producers failed and ``NonFiniteLoss`` at
        a non-finite loss under ``on_nan="stop"`` (nothing is saved then).
        """
        assert self.feed is not None and self.model is not None
        plan = fit_plan(self.options, self.step_base, self.passes_trained() or 0)
        if plan is None:  # a checkpoint of the run's last step: nothing left to train
            log.info("the run's %d steps were done before the checkpoint", self.step_base)
        else:
            self._fit(plan, stop, health_check)
        if self.checkpoints is not None:
            self.checkpoints.final(self.steps_done, self.finished(self.steps_done))

    def _fit(
        self, plan: FitPlan, stop: threading.Event, health_check: Callable[[], None] | None
    ) -> None:
        """``fit`` by ``plan`` (``resume_fit.FitPlan``), then the verdict; raises a failure."""
        assert self.feed is not None and self.model is not None
        iterations_before = int(self.model.optimizer.iterations)
        watch = _Watch(self, stop, health_check).start()
        # The model was checked at start (check_model); every stop goes through self.stops.
        books = FeedCallback(self.feed, check_model=False, stops=self.stops)
        callbacks: list[keras.callbacks.Callback] = [books, _Steps(self, books)]
        if plan.first_epoch_steps:
            callbacks.append(EpochCut(plan.first_epoch_steps, self.stops))
        self._pass_cut = None
        if plan.steps_per_epoch == PASS_EPOCH_STEPS:  # epochs that are passes
            self._pass_cut = PassCut(self.stops)
            callbacks.append(self._pass_cut)
        try:
            with warnings.catch_warnings():  # the data ending inside an epoch is expected
                warnings.filterwarnings("ignore", message=".*ran out of data")
                self.model.fit(
                    self._dataset,
                    epochs=plan.epochs,
                    initial_epoch=plan.initial_epoch,
                    steps_per_epoch=plan.steps_per_epoch,
                    callbacks=callbacks,
                    shuffle=False,  # a stream: producers decide the order
                    verbose=0,
                )
        except Exception as exc:  # noqa: BLE001 - TensorFlow's error in the step: the run fails
            log.debug("fit raised", exc_info=True)
            self._failure = self._failure or model_ref.step_failed(self.options.model, exc)
        finally:
            watch.close()
        _count_trained_steps_only(self.model, iterations_before + self.steps_done - self.step_base)
        figures = self.feed.figures()
        self._queued = figures.in_queue
        verdict = watch.run_end.verdict
        if verdict.ending is Ending.RUNNING and self._failure is None and self.passes_done():
            verdict = watch.run_end.settle()  # the last batch may train before its ``end``
        if verdict.ending is Ending.DRAIN and figures.queued == 0 and self._failure is None:
            # A last batch may train before its producer's ``end_pass`` is booked: log the
            # epochs that the whole run's batches complete, now that every end is in.
            self.passes_ended(self.steps_done - self.step_base)
            self.data_ended = verdict.data_ended
            self.drained_because = verdict.reason
            log.info("%s and every batch was trained", verdict.reason)
        if self._failure is None and verdict.failure is not None:  # drained, then fail
            self._failure = verdict.failure
        if self._failure is not None:
            raise self._failure

    def fail(self, failure: BaseException) -> None:
        """Stop ``fit`` after the current step; ``train`` raises ``failure`` once it returned."""
        if self._failure is None:
            self._failure = failure
        assert self.model is not None and self.feed is not None
        self.stops.stop(f"the run failed: {type(failure).__name__}")
        self.feed.queue.close()

    def after_step(self, record: StepRecord, in_queue: int) -> None:
        """(``fit``'s thread) book the step, apply the loss policy, checkpoint if due."""
        self._queued = in_queue
        try:
            self.book_step(record)
        except NonFiniteLoss as exc:
            self.fail(exc)
            return
        self.epoch_ended(record.step)
        if self.passes_ended(record.step - self.step_base) and self._pass_cut is not None:
            self._pass_cut.cut()  # fit's epoch is the pass: every shard's, nothing of the next
        if 0 < self.steps_planned <= record.step:
            self.stops.stop(f"the planned {self.steps_planned} steps are trained")
        elif self.passes_done():
            self.stops.stop(f"the planned {self.options.epochs} passes are trained")
        if self.checkpoints is not None:
            self.checkpoints.after_step(record.step)

    def close(self) -> None:
        """Idempotent: no more credit, the queue closes, the intake's threads are joined."""
        if self._closed:
            return
        self._closed = True
        if self.feed is not None:
            self.feed.close()


def _count_trained_steps_only(model: keras.Model, trained: int) -> None:
    """``optimizer.iterations`` back to the steps trained, if ``fit`` counted one more.

    Keras 3 on TensorFlow (3.15, TF 2.21) counts one iteration too many when a dataset of
    unknown length ends: the call that meets the end runs the counter's ``assign_add``, which
    no data op feeds, before ``get_next`` fails (measured: plain ``tf.data`` of 20 batches
    behind a ``filter`` ends ``fit`` with ``iterations`` 21; no weight moves in that call).
    A learning-rate schedule and a resumed run read this counter, so it must equal the steps
    the books say were trained.
    """
    iterations = model.optimizer.iterations
    counted = int(iterations)
    if counted > trained:
        log.info("optimizer.iterations %d -> %d: the steps trained (Keras counts the call that "
                 "met the end of the data)", counted, trained)  # fmt: skip
        iterations.assign(trained)


class _Steps(keras.callbacks.Callback):
    """After ``FeedCallback`` has booked a step: its ``StepRecord``, to the trainer."""

    def __init__(self, trainer: KerasTrainer, books: FeedCallback) -> None:
        super().__init__()
        self.trainer = trainer
        self.books = books  # runs first: its figures of the step are read here
        self._clock = StepClock()
        self._queued = 0
        self._steps = 0  # booked so far: a call of steps_per_execution books several

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._clock.restart()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        trainer = self.trainer
        figures = self.books.step_figures
        assert figures is not None
        wait, step_s, now = self._clock.split(figures.wait_s)
        step = trainer.step_base + figures.steps
        loss = (logs or {}).get("loss")
        trainer.metrics_last = {
            name: float(value)
            for name, value in (logs or {}).items()
            if name != "loss"
            and not name.startswith(self.books.prefix)
            and isinstance(value, (int, float, np.floating, np.integer))
        }
        record = StepRecord(
            step, step > trainer.options.warmup_steps, wait, step_s,
            math.nan if loss is None else float(loss), self._queued, now,
            max(1, figures.steps - self._steps),
        )  # fmt: skip
        self._steps = figures.steps
        self._queued = figures.in_queue
        trainer.after_step(record, figures.in_queue)


class _Watch:
    """The thread ``stagefeed-fit-watch`` (see the module docstring); ``close()`` joins it.

    It acts on the run's ``RunEnd`` verdict, and on any exception of its own by failing the
    run: no exception ends it silently while ``fit`` waits for a batch that will not come."""

    def __init__(
        self, trainer: KerasTrainer, stop: threading.Event, health: Callable[[], None] | None
    ) -> None:
        assert trainer.feed is not None
        self.trainer, self._feed = trainer, trainer.feed
        checks = [trainer.feed.check] + ([health] if health else [])
        self.run_end = RunEnd(stop, trainer.feed.intake.data_ended, checks)
        self._line = WaitLine(trainer.options.wait_log_s, trainer.ledger.producer_count,
                              trainer.endpoint)  # fmt: skip
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stagefeed-fit-watch", daemon=True)

    def start(self) -> _Watch:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.run_end.watch(self._done, self._act)
        except Exception as exc:  # noqa: BLE001 - carried to train(), which raises it
            log.debug("fit watcher failed", exc_info=True)
            self.trainer.fail(exc)

    def _act(self, verdict: Verdict) -> bool:
        """Do what ``verdict`` asks of ``fit``; True once there is nothing more to watch."""
        trainer = self.trainer
        assert trainer.feed is not None and trainer.model is not None
        if verdict.ending is Ending.FAIL:
            assert verdict.failure is not None
            trainer.fail(verdict.failure)
        elif verdict.ending is Ending.STOP:
            trainer.stops.stop(verdict.reason or "the run was stopped")
            trainer.feed.queue.close()
        elif verdict.ending is Ending.DRAIN:
            trainer.feed.queue.close()  # the queued tail is trained, then fit ends
        # A drain goes on watching: a stop or a failure while the tail trains still ends fit
        # after the step in progress, not after the whole tail.
        if verdict.ending in (Ending.STOP, Ending.FAIL):
            return True
        self._line.starved(trainer.steps_done, self._feed.queue.size())
        return False

    def close(self) -> None:
        self._done.set()
        join_threads([self._thread], JOIN_TIMEOUT_S)
