"""The promise matrix's data and models: rows with ids over passes, counted by the model.

``--schema tests.matrix.data:SCHEMA --source tests.matrix.data:rows``; graph mode ``--model
tests.matrix.data:graph_counter``, Keras ``--model tests.matrix.data:keras_counter``. ``ROWS``
rows, ``BATCH`` to a batch, ``PASSES`` passes (the source has passes: one per call, in an
order that differs by pass, seekable). Shard ``i`` of ``n`` carries rows ``i, i+n, ...``.
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

from stagefeed.common.schema import ArraySpec, Schema

ROWS = 192
BATCH = 4
PASSES = 2
SCHEMA = Schema(
    (ArraySpec("ids", "int32", bounds=(0, ROWS)), ArraySpec("x", "float32")), BATCH
)
COUNTS = "row_counts"
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


def rows(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Pass ``worker.epoch`` of the shard, from its batch ``worker.start``."""
    mine = np.arange(ROWS, dtype=np.int32)[worker.index :: worker.count]
    order = np.random.default_rng(worker.epoch).permutation(len(mine) // BATCH)
    pause = SLOW_BATCH_S if speed() == "slow" else 0.0
    for k in order[worker.start :]:
        time.sleep(pause)
        yield {"ids": mine[k * BATCH : (k + 1) * BATCH].copy(), "x": np.ones(BATCH, np.float32)}


rows.passes = True  # type: ignore[attr-defined]
rows.seekable = True  # type: ignore[attr-defined]


def stream(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The shard's passes one after the other as one stream, without passes (a cluster refuses
    sources with passes): batch ``k`` is batch ``k % per_pass`` of pass ``k // per_pass``."""
    per_pass = batches_per_pass(worker.count)
    for k in range(worker.start, per_pass * PASSES):
        one = dataclasses.replace(worker, epoch=k // per_pass, start=k % per_pass)
        yield next(iter(rows(schema, one)))


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


def _sleep(seconds):
    time.sleep(float(seconds))
    return np.float32(0.0)


def graph_counter(staged, schema):
    """Graph mode: ``row_counts[ROWS]`` += one-hot of the batch's ids; each step sleeps
    as its speed says; loss 0."""
    import tensorflow as tf

    v1 = tf.compat.v1
    counts = v1.get_variable(COUNTS, [ROWS], tf.float32, v1.zeros_initializer(), trainable=False)
    ids = tf.cast(staged["ids"], tf.int32)
    pause = tf.numpy_function(_sleep, [tf.constant(_step_pause())], tf.float32)
    with tf.control_dependencies([pause]):
        add = counts.assign_add(tf.reduce_sum(tf.one_hot(ids, ROWS), axis=0))
    loss = tf.reduce_sum(staged["x"]) * 0.0
    return loss, tf.group(add)


def graph_counts(prefix: str) -> np.ndarray:
    """``row_counts`` of a graph checkpoint (``DIR/model.ckpt``)."""
    import tensorflow as tf

    return tf.train.load_checkpoint(prefix).get_tensor(COUNTS)


def keras_counter(schema):
    """Keras: ``row_counts[ROWS]`` += one-hot of the ids in training calls (all-reduced, so
    every cluster worker's copy is the same) and a scalar ``w`` fit to ``x``; each training
    call sleeps as its speed says."""
    import keras

    ids = keras.Input(shape=(), name="ids", dtype="int32")
    model = keras.Model(ids, _counter_layer()(ids), name="matrix_counter")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


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


def _counter_layer():
    import keras
    import tensorflow as tf

    pause = _step_pause()

    class RowCounter(keras.layers.Layer):
        def build(self, shape):
            self.counts = self.add_weight(
                shape=(ROWS,), initializer="zeros", trainable=False, name=COUNTS
            )
            self.w = self.add_weight(shape=(), initializer="zeros", name="w")

        def call(self, ids, training=None):
            if training:
                waited = tf.reshape(tf.numpy_function(_sleep, [tf.constant(pause)], tf.float32), [])
                rows = tf.reduce_sum(tf.one_hot(ids, ROWS), axis=0) + waited
                context = tf.distribute.get_replica_context()
                self.counts.assign_add(context.all_reduce("sum", rows))
            return tf.zeros_like(tf.cast(ids, "float32")) + self.w

    return RowCounter(name="counter")


def keras_counts(path: str) -> np.ndarray:
    """``row_counts`` of a ``.keras`` or ``.weights.h5`` file of ``keras_counter``."""
    model = keras_counter(SCHEMA)
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model.get_layer("counter").counts.numpy()


def miscounted(counts: np.ndarray) -> dict[int, float]:
    """Rows not trained exactly ``PASSES`` times, with their counts (empty: all were)."""
    assert counts.shape == (ROWS,), counts.shape
    return {int(i): float(counts[i]) for i in np.flatnonzero(counts != PASSES)}
