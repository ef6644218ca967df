"""Models whose state counts how often each row id was trained, for the exactly-once tests
(``resume_models``, ``run_length_models``, ``tests/matrix/data.py`` build theirs from these).

Every batch holds ``ids`` (int32 row ids in ``[0, rows)``) and ``x`` (float32 ones). The graph
counter adds the one-hot of the batch's ids to ``row_counts[rows]`` each step, loss 0. The Keras
layer ``counter`` does the same in training calls only, all-reduced over the replicas (a
cluster's workers: every copy the same; one device: the rows themselves), beside one trainable
scalar ``w`` fit to ``x``. ``pause_s``: each step also sleeps that long (a trainer of a known
speed).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

COUNTS = "row_counts"


def sleep_for(seconds: Any) -> np.float32:
    """Sleep ``seconds`` (a step of a known speed); 0.0, as a tensor to depend on."""
    time.sleep(float(seconds))
    return np.float32(0.0)


def graph_row_counter(staged: dict[str, Any], rows: int, pause_s: float = 0.0) -> tuple:
    """Graph mode: ``(loss, train_op)`` adding the batch's ids to ``row_counts[rows]``."""
    import tensorflow as tf

    v1 = tf.compat.v1
    counts = v1.get_variable(COUNTS, [rows], tf.float32, v1.zeros_initializer(), trainable=False)
    ids = tf.cast(staged["ids"], tf.int32)
    waits = [tf.numpy_function(sleep_for, [tf.constant(pause_s)], tf.float32)] if pause_s else []
    with tf.control_dependencies(waits):
        add = counts.assign_add(tf.reduce_sum(tf.one_hot(ids, rows), axis=0))
    loss = tf.reduce_sum(staged["x"]) * 0.0
    return loss, tf.group(add)


def graph_counts(prefix: str) -> np.ndarray:
    """``row_counts`` of a graph checkpoint (``DIR/model.ckpt``)."""
    import tensorflow as tf

    return tf.train.load_checkpoint(prefix).get_tensor(COUNTS)


def keras_row_counter(name: str, rows: int, optimizer: Any, pause_s: float = 0.0) -> Any:
    """A compiled Keras model: ``ids`` -> the ``counter`` layer, MSE against ``x``."""
    import keras

    ids = keras.Input(shape=(), name="ids", dtype="int32")
    model = keras.Model(ids, _counter_layer(rows, pause_s)(ids), name=name)
    model.compile(optimizer, "mse")
    return model


def _counter_layer(rows: int, pause_s: float) -> Any:
    import keras
    import tensorflow as tf

    class RowCounter(keras.layers.Layer):
        def build(self, shape):
            self.counts = self.add_weight(
                shape=(rows,), initializer="zeros", trainable=False, name=COUNTS
            )
            self.w = self.add_weight(shape=(), initializer="zeros", name="w")

        def call(self, ids, training=None):
            if training:
                seen = tf.reduce_sum(tf.one_hot(ids, rows), axis=0)
                if pause_s:
                    seen += tf.reshape(
                        tf.numpy_function(sleep_for, [tf.constant(pause_s)], tf.float32), []
                    )
                context = tf.distribute.get_replica_context()
                self.counts.assign_add(context.all_reduce("sum", seen))
            return tf.zeros_like(tf.cast(ids, "float32")) + self.w

    return RowCounter(name="counter")


def keras_counts(model: Any, path: str) -> np.ndarray:
    """``row_counts`` of a ``.keras`` or ``.weights.h5`` file of ``model``'s build."""
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model.get_layer("counter").counts.numpy()
