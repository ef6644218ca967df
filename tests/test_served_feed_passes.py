"""The public API maps passes to Keras epochs (issue 28, defect 5): ``ServedFeed`` and
``fit(epochs=E)`` without ``steps_per_epoch`` on a source with passes gives E epochs, one a
pass, each with its validation; real producer processes (``stagefeed produce``) of the
sources with passes in ``tests/helpers/run_length_models.py``, a row-counting Keras model.

``saved(position)`` decides ``finished`` by the same rule as the CLI trainers
(``run_end.finished_because``): the last position, all passes trained, lets the producers go.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from stagefeed import ServedFeed, TrainerOptions
from stagefeed.common.errors import ConfigError
from tests.conftest import free_tcp_port
from tests.helpers.procs import log_text
from tests.helpers.run_length_models import BATCH, PER_PASS, ROWS, SCHEMA, keras_counter

PASSES = 3


def _options(epochs: int) -> TrainerOptions:
    return TrainerOptions(bind=f"tcp://127.0.0.1:{free_tcp_port()}", schema=SCHEMA,
                          queue_mb=1, stage_depth=2, epochs=epochs)  # fmt: skip


def _producers(spawn, feed: ServedFeed, source: str = "fast_rows"):
    return spawn(["produce", "--connect", feed.endpoint, "--workers", "2", "--schema",
                  "tests.helpers.run_length_models:SCHEMA", "--source",
                  f"tests.helpers.run_length_models:{source}"], "producers")  # fmt: skip


class _CountsPerEpoch(keras.callbacks.Callback):
    """The model's row counts at each epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[np.ndarray] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seen.append(self.model.get_layer("counter").counts.numpy().copy())


def test_fit_epochs_on_a_served_feed_of_passes_are_its_passes_each_with_validation(spawn):
    validation = tf.data.Dataset.from_tensor_slices(
        (np.zeros(2 * BATCH, np.int32), np.ones(2 * BATCH, np.float32))
    ).batch(BATCH)
    counts = _CountsPerEpoch()
    with ServedFeed(_options(PASSES), confirm_saves=True) as feed:
        producers = _producers(spawn, feed, "slow_rows")
        model = keras_counter(SCHEMA)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(
                feed.dataset(("ids", "x")), epochs=PASSES, validation_data=validation,
                callbacks=[feed.callback(), counts], shuffle=False, verbose=0,
            ).history  # fmt: skip
        feed.check()
        position = feed.position()
        feed.saved(position)  # finished: decided by the rule (every pass trained)
        assert feed.ledger.shards.finished, (position.to_dict(), history)
    assert producers.wait(60) == 0, log_text(producers)[-3000:]
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert len(history["loss"]) == PASSES and len(history["val_loss"]) == PASSES, history
    assert history["stagefeed_trained"] == [PER_PASS * k for k in range(1, PASSES + 1)], history
    assert history["stagefeed_abandoned"][-1] == 0, history
    for epoch, seen in enumerate(counts.seen, start=1):  # epoch k: every row k times
        assert seen.shape == (ROWS,) and not (seen != epoch).any(), (epoch, seen)
    text = log_text(producers)  # let go by the last checkpoint, not stopped while waiting
    assert text.count("the trainer saved all 72 batches") == 2, text[-3000:]


def test_fit_epochs_that_the_producers_passes_cannot_give_are_refused_in_one_line(spawn):
    with ServedFeed(_options(1)) as feed:
        producers = _producers(spawn, feed)
        model = keras_counter(SCHEMA)
        with pytest.raises(ConfigError, match=r"fit\(epochs=3\) .* TrainerOptions\(epochs=1\)"):
            model.fit(feed.dataset(("ids", "x")), epochs=3, callbacks=[feed.callback()],
                      verbose=0)  # fmt: skip
    producers.kill_group()
