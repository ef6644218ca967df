"""A Keras run's checkpoint, and ``fit`` going on from one (docs/resume.md).

``keras_format(model)`` saves the whole model (weights, non-trainable state, optimizer) as one
``.keras`` file, and restores it into the model ``--model`` just built: the optimizer is built
first, so that ``load_weights`` fills its slots and ``iterations`` instead of skipping them (a
skipped part is a ``ConfigError``, never a silent half-restore).

``fit_plan(options, step)``: what ``fit`` is asked for to train the steps left after ``step``
(the checkpoint's): ``initial_epoch`` is the epoch that step is in, and when it is inside an
epoch, ``EpochCut`` ends that first epoch after the steps it has left. ``fit`` keeps one
iterator across epochs when ``steps_per_epoch`` is given (Keras 3's ``EpochIterator``), so
cutting an epoch short drops no prefetched batch: the next epoch goes on with the same
iterator. No position here: the batches are booked by ``FeedCallback`` (the trainer's books).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
import zipfile

import keras

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer.checkpoints import ModelFormat
from stagefeed.consumer.keras_fit.fit_stops import FitStops

log = logging.getLogger(__name__)


def keras_format(model: keras.Model) -> ModelFormat:
    """``model.save``: the whole model (weights and optimizer) as one ``.keras`` file;
    ``restore``: ``restore_keras`` of that file into ``model``."""

    def save(path: str) -> list[str]:
        model.save(path)
        return [os.path.basename(path)]

    return ModelFormat(
        final="model.keras",
        at_step=lambda step: f"step-{step:06d}.keras",
        save=save,
        restore=lambda path: restore_keras(model, path),
    )


def restore_keras(model: keras.Model, path: str) -> None:
    """``load_weights`` of the ``.keras`` file at ``path`` into ``model``, its optimizer built
    first; ``ConfigError`` where the file cannot be read or does not fit the model."""
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)  # its slots exist: they are loaded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.load_weights(path)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            why = " ".join(str(exc).split())[:200]
            raise ConfigError(f"cannot restore checkpoint {path}: {type(exc).__name__}: "
                              f"{why}; pass --fresh to start over") from None  # fmt: skip
    skipped = [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
    if skipped:
        why = " ".join(skipped[0].split())
        raise ConfigError(f"checkpoint {path} does not fit the model: {why}; pass --fresh "
                          "to start over")  # fmt: skip


def restore_iterations(model: keras.Model, step: int) -> None:
    """``optimizer.iterations`` is the checkpoint's ``step`` after a restore (a schedule reads
    it); said in the log when the file held another count."""
    iterations = model.optimizer.iterations
    now = int(iterations.numpy())  # not int(): a strategy's mirrored variable has no __int__
    if now != step:
        log.info("optimizer.iterations %d -> %d: the checkpoint's step", now, step)
        iterations.assign(step)


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """``fit``'s ``epochs``, ``initial_epoch`` and ``steps_per_epoch`` for the steps left;
    ``first_epoch_steps``: the steps left in the first epoch when a checkpoint fell inside it
    (0: the first epoch is whole)."""

    epochs: int
    initial_epoch: int
    steps_per_epoch: int | None
    first_epoch_steps: int = 0


def fit_plan(options: TrainerOptions, step: int, passes: int = 0) -> FitPlan | None:
    """The plan to train the run's steps after ``step`` (``passes``: the passes of a source
    with passes its checkpoint had trained); None if none are left.

    Epochs that are passes (``--epochs E`` without ``--steps``): ``fit``'s epochs ``passes``
    to ``E``, each ended at its pass boundary by ``PassCut``; where the source turns out to
    have no passes, the trainer ends ``fit`` at its planned steps (``steps_planned``)."""
    per_epoch, total = options.steps_per_epoch, options.total_steps
    if per_epoch:
        if step >= total:
            return None
        left = -step % per_epoch  # steps left in the epoch the checkpoint fell in (0: none)
        return FitPlan(options.epochs, step // per_epoch, per_epoch, left)
    if options.length_by_passes or (options.epochs > 1 and not total):
        return None if passes >= options.epochs else FitPlan(options.epochs, passes,
                                                              PASS_EPOCH_STEPS)  # fmt: skip
    if total and step >= total:
        return None
    return FitPlan(1, 0, total - step if total else None)


# ``steps_per_epoch`` for epochs that are passes: never reached (``PassCut`` ends an epoch at
# its pass boundary, the end of the data ends the last); given, so that ``fit`` keeps one
# iterator across epochs and no prefetched batch of the next pass is dropped.
PASS_EPOCH_STEPS = 2**40


class PassCut(keras.callbacks.Callback):
    """Epochs that are passes (docs/resume.md, "Passes"): ``fit``'s epoch ends at the step that
    trains the last batch of every shard's pass (``cut()``, from the trainer's pass books),
    then ``fit`` goes on to the next at that epoch's end, unless the run is stopping
    (``FitStops``: its place among the callbacks does not matter)."""

    def __init__(self, stops: FitStops) -> None:
        super().__init__()
        self.stops = stops
        self._cut = False

    def cut(self) -> None:
        """(the step's callbacks) the step just trained ended a pass: end the epoch."""
        self._cut = True
        self.stops.cut_epoch("every shard's pass is trained")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._cut:
            self._cut = False
            log.info("fit's epoch %d ended at its pass boundary", epoch + 1)
            self.stops.go_on()


class EpochCut(keras.callbacks.Callback):
    """Ends ``fit``'s first epoch after ``steps`` steps, then lets ``fit`` go on to the next
    epoch at that epoch's end, unless the run is stopping (``FitStops``: a later
    ``on_epoch_end`` that stops ``fit``, the feed's end of data, is never undone, whatever the
    callbacks' order)."""

    def __init__(self, steps: int, stops: FitStops) -> None:
        super().__init__()
        self.steps = steps
        self.stops = stops
        self._armed = steps > 0
        self._cut = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._armed and batch + 1 >= self.steps:
            self._armed, self._cut = False, True
            self.stops.cut_epoch(f"the {self.steps} steps left of a resumed epoch are trained")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._cut:
            self._cut = False
            log.info("epoch %d: the %d steps it had left after the checkpoint are done",
                     epoch + 1, self.steps)  # fmt: skip
            self.stops.go_on()
