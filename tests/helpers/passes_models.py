"""Rows counted per pass, and whether any batch was trained before a batch of an earlier pass:
``tests/test_passes.py`` checks that an epoch is every shard's pass (docs/resume.md, "Passes").

``--schema tests.helpers.passes_models:SCHEMA --source tests.helpers.passes_models:rows --model
tests.helpers.passes_models:pass_counter``. Shard ``i`` of ``n`` carries rows ``i, i+n, ...``; the
source makes one pass per call (``passes = True``), in an order that differs by pass, and
tags each batch with its pass (``x``). Shard 0 is slower than the others, so without passes
the producers' passes would mix in the trainer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from stagefeed.common.schema import ArraySpec, Schema

ROWS = 240
BATCH = 4
PASSES = 3
SCHEMA = Schema(
    (ArraySpec("ids", "int32", bounds=(0, ROWS)), ArraySpec("x", "float32")), BATCH
)
COUNTS, DISORDER = "pass_row_counts", "disorder"


def rows(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Pass ``worker.epoch`` of the shard, from its batch ``worker.start`` (seekable)."""
    mine = np.random.default_rng(worker.epoch).permutation(np.arange(ROWS, dtype=np.int32))
    mine = np.sort(mine[worker.index :: worker.count])
    order = np.random.default_rng(100 + worker.epoch).permutation(len(mine) // BATCH)
    for k in order[worker.start :]:
        if worker.index == 0:
            time.sleep(0.005)  # a slow shard: the others would run ahead into their next pass
        ids = mine[k * BATCH : (k + 1) * BATCH]
        yield {"ids": ids, "x": np.full(BATCH, worker.epoch, np.float32)}


rows.passes = True  # type: ignore[attr-defined]
rows.seekable = True  # type: ignore[attr-defined]


def pass_counter(staged, schema):
    """``pass_row_counts[PASSES, ROWS]`` += the batch's rows in its pass's row; ``disorder``
    += 1 for a batch of a pass before the highest pass trained so far; loss 0."""
    import tensorflow as tf

    v1 = tf.compat.v1
    counts = v1.get_variable(COUNTS, [PASSES, ROWS], tf.float32, v1.zeros_initializer(),
                             trainable=False)  # fmt: skip
    disorder = v1.get_variable(DISORDER, [], tf.float32, v1.zeros_initializer(),
                               trainable=False)  # fmt: skip
    highest = v1.get_variable("highest_pass", [], tf.int32, v1.zeros_initializer(),
                              trainable=False)  # fmt: skip
    ids = tf.cast(staged["ids"], tf.int32)
    tag = tf.cast(staged["x"][0], tf.int32)
    before = highest.read_value()
    late = tf.cast(tag < before, tf.float32)
    add = counts.scatter_nd_add(tf.stack([tf.fill(tf.shape(ids), tag), ids], axis=1),
                                tf.ones(tf.shape(ids), tf.float32))  # fmt: skip
    with tf.control_dependencies([late]):
        order = tf.group(disorder.assign_add(late), highest.assign(tf.maximum(before, tag)))
    loss = tf.reduce_sum(staged["x"]) * 0.0
    return loss, tf.group(add, order)


def keras_linear(schema):
    """A compiled Keras model of ``x`` -> ``ids`` (its targets): the Keras run of passes."""
    import keras

    x = keras.Input((), name="x", dtype="float32")
    out = keras.layers.Dense(1)(keras.layers.Reshape((1,))(x))
    model = keras.Model(x, out, name="pass_linear")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def model_state(prefix: str) -> tuple[np.ndarray, float]:
    """``(pass_row_counts, disorder)`` of a graph checkpoint (``DIR/model.ckpt``)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    return reader.get_tensor(COUNTS), float(reader.get_tensor(DISORDER))
