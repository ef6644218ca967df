"""Keras 3 side of the TF 2 feed: a callback that books each step, and the cast as a layer.

``FeedCallback`` books, after every ``train_function`` call, exactly the batches its steps
consumed (``steps_per_execution`` steps per call: ``end - begin + 1`` of the batch numbers
Keras passes), and adds the feed's figures to the batch and epoch logs, hence to ``History``
and the progress bar. It defines ``on_train_batch_end``, so Keras never dispatches it
asynchronously: booking happens on the training thread, right after the step.

At the end of an epoch, a feed that is closed and drained stops ``fit``: a finite source or a
shutdown ends ``fit`` after the epoch in which the data ran out, instead of running the
remaining epochs on an ended dataset. ``model.stop_training`` is written only through a
``FitStops`` (``consumer.keras_fit.fit_stops``: its own, or the trainer's when given).

At the start of ``fit`` it checks the model against the feed's dataset (``Feed.check_model``:
compiled with a loss, the loss fits the labels' declared values, one step traced on the
dataset's elements), so a model that cannot train on the feed fails with one
``stagefeed.ConfigError`` line before any batch is taken, not TensorFlow's error at the first
step.

Epochs that are passes (a ``ServedFeed`` of a source with passes, ``fit`` given no
``steps_per_epoch``: ``Feed.fit_begins``): the step that trains the last batch of every
shard's pass ends ``fit``'s epoch (``FitStops.cut_epoch``), and the epoch's end lets ``fit``
go on to the next (its validation and callbacks ran in between); the dataset's iterator took
nothing of the next pass (``consumer.tf2.pass_gate``). Its place among ``fit``'s callbacks does
not matter: going on never undoes a stop, nor a flag another callback set.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import keras

from stagefeed.common.schema import ArraySpec
from stagefeed.consumer.keras_fit.fit_stops import FitStops

if TYPE_CHECKING:
    from stagefeed.consumer.tf2.feed import Feed
    from stagefeed.consumer.tf2.step_books import BooksFigures

log = logging.getLogger(__name__)


def cast_layer(spec: ArraySpec) -> keras.layers.Layer:
    """``Rescaling(scale, dtype=cast)``: casts the input to ``cast`` then multiplies.

    A built-in layer, so a saved ``.keras`` model reloads without custom objects, and it runs
    inside the step, on the replica's device: the wire dtype crosses to the device.
    """
    return keras.layers.Rescaling(
        scale=1.0 if spec.scale is None else spec.scale,
        dtype=spec.cast or spec.dtype,
        name=f"{spec.name}_cast",
    )


class FeedCallback(keras.callbacks.Callback):
    """Books trained batches per step and reports ``{prefix}trained``, ``{prefix}abandoned``,
    ``{prefix}queue_fill`` (queue fraction at the step's end) and ``{prefix}input_wait``
    (share of the run's wall time the trained batches' dequeues blocked on an empty queue).
    ``stops``: the owner of ``model.stop_training`` it shares with a trainer (None: its own).
    """

    def __init__(
        self,
        feed: Feed,
        prefix: str = "stagefeed_",
        check_model: bool = True,
        stops: FitStops | None = None,
    ) -> None:
        super().__init__()
        self.feed = feed
        self.stops = FitStops() if stops is None else stops
        self.prefix = prefix
        self.check_model = check_model  # False: the caller checked it (the CLI's trainer)
        self._first_step = 0
        # The books after the last step, taken once a step (a snapshot drains the dequeue log
        # and asks TensorFlow for the queue's size): callbacks after this one read it here.
        self.step_figures: BooksFigures | None = None
        self._passes = False  # fit's epochs are passes (module docstring)
        self._cut = False  # the step just trained ended a pass: the epoch ends

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stops.bind(self.model)  # after fit cleared the flag: a stop asked before holds
        if self.check_model:  # before any batch: one ConfigError line, not TF's at step 1
            self.feed.check_model(self.model)
        self.feed.books.begin()
        params = self.params or {}
        self._passes = self.feed.fit_begins(params.get("epochs", 1), params.get("steps"))
        self._cut = False

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._first_step = batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.feed.books.step_done(batch - self._first_step + 1)
        self.step_figures = self.feed.books.figures()
        if logs is not None:
            logs.update(self.step_figures.logs(self.prefix))
        if self._passes and self.feed.passes_ended(self.step_figures.trained):
            self._cut = True
            self.stops.cut_epoch("every shard's pass is trained")
        self.feed.raise_owed_interrupt()  # a Ctrl-C during the step, booked: fit ends here

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        figures = self.feed.books.figures()
        if logs is not None:
            logs.update(figures.logs(self.prefix))
        if self._cut:  # the epoch was the pass: fit goes on to the next one
            self._cut = False
            self.stops.go_on()
        if self.feed.queue.closed and figures.queued == 0:
            log.info("feed closed and drained after epoch %d: stopping fit", epoch + 1)
            self.stops.stop("the feed closed and drained")

    def on_train_end(self, logs: dict | None = None) -> None:
        self.feed.books.end()
        figures = self.feed.books.figures()
        # No wait figure here: ``input_wait`` (history) spans all of fit, tracing included,
        # and would read as a second "stall" beside the summary's (docs/observability.md).
        log.info(
            "fit ended: %d batches trained in %d steps, %d abandoned, %d queued",
            figures.trained,
            figures.steps,
            figures.abandoned,
            figures.queued,
        )
