"""The promise matrix's data and models: rows with ids over passes, counted by the model.

``--schema tests.matrix.data:SCHEMA --source tests.matrix.data:rows``; graph mode ``--model
tests.matrix.data:graph_counter``, Keras ``--model tests.matrix.data:keras_counter``. ``ROWS``
rows, ``BATCH`` to a batch, ``PASSES`` passes. ``rows`` is a ``stagefeed.MapSource`` over the
arrays (what a user's data is: passes, a seeded shuffle per epoch, the data's order in the
hello, so a checkpoint resumes at another producer count); ``rows_stream`` the same with its
epochs as one stream (a cluster refuses sources with passes). ``stream`` (what ``failing``
fails in) is a user's generator: shard ``i`` of ``n`` carries rows ``i, i+n, ...``, each pass
in another order, all passes as one stream.
After a complete run every row's count is ``PASSES``.

The speed of a cell (``STAGEFEED_MATRIX_SPEED``, read by the source and the model, both user
code): ``fast`` producers make batches at once and each step sleeps ``FAST_STEP_S`` (the
trainer is the bottleneck: queues full, a stop or a kill meets batches queued); ``slow``
producers sleep ``SLOW_BATCH_S`` a batch and a step ``SLOW_STEP_S`` (the trainer waits for
data: a stop or a kill meets it waiting, the data ends while it is idle).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import numpy as np

import stagefeed
from stagefeed.common.schema import ArraySpec, Schema
from tests.helpers import row_counters

ROWS = 192
BATCH = 4
PASSES = 2
SCHEMA = Schema(
    (ArraySpec("ids", "int32", bounds=(0, ROWS)), ArraySpec("x", "float32")), BATCH
)
COUNTS = row_counters.COUNTS
SPEED_ENV = "STAGEFEED_MATRIX_SPEED"
FAST_STEP_S, SLOW_STEP_S, SLOW_BATCH_S = 0.06, 0.005, 0.15
FAIL_AT = 3  # ``failing`` raises at this batch of each shard


def speed() -> str:
    value = os.environ.get(SPEED_ENV, "fast")
    if value not in ("fast", "slow"):
        raise ValueError(f"{SPEED_ENV} must be fast or slow, got {value!r}")
    return value


def batches_per_pass(shards: int) -> int:
    """A shard's batches in one pass."""
    return len(range(0, ROWS, shards)) // BATCH


def total_batches() -> int:
    """Every batch of a complete run, whatever the shard count (``ROWS`` divides evenly)."""
    return ROWS * PASSES // BATCH


def _pace(record: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``rows``' transform: a slow cell's producers take ``SLOW_BATCH_S`` a batch."""
    if speed() == "slow":
        time.sleep(SLOW_BATCH_S / BATCH)
    return record


ARRAYS = {"ids": np.arange(ROWS, dtype=np.int32), "x": np.ones(ROWS, np.float32)}
rows = stagefeed.MapSource(stagefeed.ArrayRecords(ARRAYS), seed=3, transform=_pace,
                           name="matrix rows")  # fmt: skip
# The cluster's (a cluster refuses sources with passes): the same data, its PASSES epochs as
# one stream.
rows_stream = stagefeed.MapSource(stagefeed.ArrayRecords(ARRAYS), seed=3, transform=_pace,
                                  name="matrix rows", epochs=PASSES)  # fmt: skip


def _shard_pass(worker) -> Iterator[dict[str, np.ndarray]]:
    """Pass ``worker.epoch`` of the shard (rows ``index, index+count, ...`` in an order drawn
    from the pass), from its batch ``worker.start``."""
    mine = np.arange(ROWS, dtype=np.int32)[worker.index :: worker.count]
    order = np.random.default_rng(worker.epoch).permutation(len(mine) // BATCH)
    pause = SLOW_BATCH_S if speed() == "slow" else 0.0
    for k in order[worker.start :]:
        time.sleep(pause)
        yield {"ids": mine[k * BATCH : (k + 1) * BATCH].copy(), "x": np.ones(BATCH, np.float32)}


def stream(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The shard's passes one after the other as one stream, without passes (a cluster refuses
    sources with passes): batch ``k`` is batch ``k % per_pass`` of pass ``k // per_pass``."""
    per_pass = batches_per_pass(worker.count)
    for k in range(worker.start, per_pass * PASSES):
        one = dataclasses.replace(worker, epoch=k // per_pass, start=k % per_pass)
        yield next(_shard_pass(one))


stream.seekable = True  # type: ignore[attr-defined]


def failing(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The shard's stream: its first ``FAIL_AT`` batches, then a ``ValueError`` (user code
    failing)."""
    for k, batch in enumerate(stream(schema, worker)):
        if k == FAIL_AT:
            raise ValueError(f"matrix source fails at batch {FAIL_AT} on purpose")
        yield batch


def _step_pause() -> float:
    return FAST_STEP_S if speed() == "fast" else SLOW_STEP_S


def graph_counter(staged, schema):
    """Graph mode: ``row_counts[ROWS]`` += one-hot of the batch's ids; each step sleeps
    as its speed says; loss 0."""
    return row_counters.graph_row_counter(staged, ROWS, pause_s=_step_pause())


def graph_counts(prefix: str) -> np.ndarray:
    """``row_counts`` of a graph checkpoint (``DIR/model.ckpt``)."""
    return row_counters.graph_counts(prefix)


def keras_counter(schema):
    """Keras: ``row_counts[ROWS]`` += one-hot of the ids in training calls (all-reduced, so
    every cluster worker's copy is the same) and a scalar ``w`` fit to ``x``; each training
    call sleeps as its speed says."""
    import keras

    return row_counters.keras_row_counter(
        "matrix_counter", ROWS, keras.optimizers.SGD(0.01), pause_s=_step_pause()
    )


def keras_wrong_output(schema):
    """A compiled Keras model whose output, ``(None, 10)``, cannot fit the scalar target
    ``x`` under MSE: the bad model of the matrix."""
    import keras

    ids = keras.Input(shape=(), name="ids", dtype="int32")
    hidden = keras.layers.Reshape((1,))(keras.ops.cast(ids, "float32"))
    model = keras.Model(ids, keras.layers.Dense(10)(hidden), name="wrong_output")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def graph_wrong_labels(staged, schema):
    """Graph mode: a loss that needs ``labels``, an array the schema does not have."""
    import tensorflow as tf

    loss = tf.reduce_mean(staged["labels"])
    return loss, tf.group(loss)


def keras_counts(path: str) -> np.ndarray:
    """``row_counts`` of a ``.keras`` or ``.weights.h5`` file of ``keras_counter``."""
    return row_counters.keras_counts(keras_counter(SCHEMA), path)


def miscounted(counts: np.ndarray) -> dict[int, float]:
    """Rows not trained exactly ``PASSES`` times, with their counts (empty: all were)."""
    assert counts.shape == (ROWS,), counts.shape
    return {int(i): float(counts[i]) for i in np.flatnonzero(counts != PASSES)}
