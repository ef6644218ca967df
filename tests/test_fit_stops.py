"""``model.stop_training`` has one owner (issue 29): ``FitStops`` (a reason per stop, stopping
wins over going on), called by ``FeedCallback``, ``PassCut``/``EpochCut`` and the Keras
trainer; the callbacks' order no longer matters (it was "Put it first"). The rule on a plain
object, then in a real Keras ``fit`` with the cut placed after a callback that stops.

Covers consumer/keras_fit/fit_stops.py, consumer/keras_fit/resume_fit.py (``EpochCut``).
"""

from __future__ import annotations

import threading
import types

import keras
import numpy as np
import pytest

from stagefeed.consumer.keras_fit.fit_stops import FitStops, Halt
from stagefeed.consumer.keras_fit.resume_fit import EpochCut


def _model() -> types.SimpleNamespace:
    return types.SimpleNamespace(stop_training=False)


def test_a_cut_epoch_goes_on_and_says_why():
    model = _model()
    stops = FitStops(model)
    stops.cut_epoch("a pass")
    assert model.stop_training and model.stop_training == Halt("a pass", ends_fit=False)
    assert stops.go_on() is True and model.stop_training is False
    assert stops.stopped is None


@pytest.mark.parametrize("order", ["stop-then-cut", "cut-then-stop"])
def test_a_stop_wins_over_going_on_whatever_the_order(order):
    model = _model()
    stops = FitStops(model)
    calls = [lambda: stops.stop("the planned steps"), lambda: stops.cut_epoch("a pass")]
    for call in calls if order == "stop-then-cut" else calls[::-1]:
        call()
    assert stops.go_on() is False
    assert model.stop_training == Halt("the planned steps", ends_fit=True)
    assert stops.stopped == "the planned steps"


def test_a_flag_set_by_another_callback_is_never_undone():
    model = _model()
    stops = FitStops(model)
    model.stop_training = True  # EarlyStopping, before the cut's epoch end
    stops.cut_epoch("a pass")  # a cut does not replace it
    assert stops.go_on() is False and model.stop_training is True
    model.stop_training = False
    stops.cut_epoch("a pass")
    model.stop_training = True  # set after the cut, before its go_on
    assert stops.go_on() is False and model.stop_training is True


def test_a_stop_from_another_thread_and_one_before_fit_hold():
    model = _model()
    stops = FitStops()
    stops.stop("SIGTERM")  # before the model is bound
    stops.bind(model)
    assert model.stop_training == Halt("SIGTERM", ends_fit=True)
    model.stop_training = False  # fit clears the flag at its start; FeedCallback binds again
    stops.bind(model)
    assert model.stop_training
    other = FitStops(_model())
    thread = threading.Thread(target=other.stop, args=("a failure",), name="test-stop")
    thread.start()
    thread.join(5)
    assert other.go_on() is False and other.stopped == "a failure"


class _StopsAtFirstEpochEnd(keras.callbacks.Callback):
    """A user's callback that stops ``fit`` at the end of its first epoch (as EarlyStopping)."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epochs.append(epoch)
        self.model.stop_training = True


def test_in_a_real_fit_a_cut_placed_after_a_stopping_callback_does_not_undo_its_stop():
    """``EpochCut`` ends the first epoch after 2 of its 5 steps, then lets ``fit`` go on; a
    callback before it stops ``fit`` at that epoch's end. The stop holds: one epoch, 2 steps
    (the cut's ``go_on``, run after it, once cleared the flag: 3 epochs ran)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 3), np.float32), np.zeros((64, 1), np.float32)
    stops = FitStops(model)
    user = _StopsAtFirstEpochEnd()
    history = model.fit(
        x, y, batch_size=4, epochs=3, steps_per_epoch=5, verbose=0,
        callbacks=[user, EpochCut(2, stops)],
    )  # fmt: skip
    assert user.epochs == [0] and len(history.history["loss"]) == 1
    assert int(model.optimizer.iterations.numpy()) == 2


def test_only_fit_stops_writes_stop_training_in_the_trainer():
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "consumer"
    writers = sorted(
        f"{path.relative_to(root)}:{node.lineno}"
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and target.attr == "stop_training"
    )
    assert {w.split(":")[0] for w in writers} == {"keras_fit/fit_stops.py"}, writers
