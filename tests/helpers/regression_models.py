"""A tiny regression for the CLI tests: ``--schema tests.helpers.regression_models:SCHEMA``.

Batches of 4 float32 feature rows and their targets (the row sums). Sources for ``--source
tests.helpers.regression_models:NAME``; models for ``--model
tests.helpers.regression_models:NAME``: a graph ``linear_fn`` and a Keras ``build`` (and Keras
builds that break the convention); ``slow_linear_fn`` is a graph step that takes
``STEP_SLEEP_S`` at least. ``nan_from_third`` sends NaN targets from its third batch
on, so with one producer and one enqueue thread (batches trained in order) the loss is first
non-finite at step 3.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from stagefeed.common.schema import ArraySpec, Schema

SCHEMA = Schema((ArraySpec("features", "float32", (3,)), ArraySpec("targets", "float32")), 4)
FIRST_NAN_SEQ = 2  # the third batch: trained at step 3


def _batches(worker, nan_from: int | None) -> Iterator[dict[str, np.ndarray]]:
    rng = np.random.default_rng(worker.seed)
    seq = 0
    while True:
        features = rng.random((SCHEMA.batch_size, 3), dtype=np.float32)
        targets = features.sum(axis=1)
        if nan_from is not None and seq >= nan_from:
            targets = np.full_like(targets, np.nan)
        yield {"features": features, "targets": targets}
        seq += 1


def sums(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches whose targets are the feature rows' sums."""
    return _batches(worker, None)


def nan_from_third(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Like ``sums``, but every target from the third batch on is NaN."""
    return _batches(worker, FIRST_NAN_SEQ)


def linear_fn(staged, schema):
    """Graph mode: a linear map fitted by SGD."""
    import tensorflow as tf

    v1 = tf.compat.v1
    w = v1.get_variable("w", [3, 1], initializer=v1.zeros_initializer())
    predicted = tf.squeeze(staged["features"] @ w, 1)
    loss = tf.reduce_mean(tf.square(predicted - staged["targets"]))
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


PACED_STEP_S = 0.1
STEP_SLEEP_S = 2.0


def slow_linear_fn(staged, schema):
    """``linear_fn`` whose every step also sleeps ``STEP_SLEEP_S``: a step in progress when a
    stop signal comes lasts that long at least, whatever the machine's load, so signals sent
    just after the first surely land while the command is still stopping."""
    return sleeping_step(*linear_fn(staged, schema), STEP_SLEEP_S)


def paced_linear_fn(staged, schema):
    """``linear_fn`` whose every step also sleeps ``PACED_STEP_S``: a trainer that takes batches
    at a known pace whatever the load, so a producer feeding two cannot give one all its batches
    before the other's welcome comes (tests/test_several_trainers.py)."""
    return sleeping_step(*linear_fn(staged, schema), PACED_STEP_S)


def sleeping_step(loss, train_op, seconds: float):
    """A graph step ``(loss, train_op)`` that also sleeps ``seconds``: its length known,
    whatever the machine's load, at no CPU."""
    import tensorflow as tf

    def _sleep(value):
        import time

        time.sleep(seconds)
        return value

    slept = tf.numpy_function(_sleep, [loss], tf.float32, stateful=True)
    with tf.control_dependencies([slept]):
        return tf.identity(loss), tf.group(train_op, slept)


def _keras_model(name: str = "features", shape=(3,), dtype: str = "float32", compiled=True):
    import keras

    inputs = keras.Input(shape, name=name, dtype=dtype)
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs), name="linear")
    if compiled:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def build(schema):
    """Keras: the same linear map, compiled; x is ``features``, y ``targets``."""
    return _keras_model()


STEP_PAUSE_S = 0.2  # ``build_in_calls_of_3``'s step: at least this long


def build_in_calls_of_3(schema):
    """A linear map whose every step sleeps ``STEP_PAUSE_S``, compiled with
    ``steps_per_execution=3``: one ``train_function`` call runs 3 steps, at least 0.6 s."""
    import keras
    import tensorflow as tf

    from tests.helpers.row_counters import sleep_for

    def paused(features):
        pause = tf.numpy_function(sleep_for, [tf.constant(STEP_PAUSE_S)], tf.float32)
        return features + tf.reshape(pause, [])

    inputs = keras.Input((3,), name="features", dtype="float32")
    hidden = keras.layers.Lambda(paused, output_shape=(3,))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden), name="paused_linear")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=3)
    return model


# Keras builds that break the convention (docs/tf2.md), one way each.
def not_a_model(schema):
    return "a model"


def uncompiled(schema):
    return _keras_model(compiled=False)


def wrong_name(schema):
    return _keras_model(name="inputs")


def wrong_shape(schema):
    return _keras_model(shape=(4,))


def wrong_dtype(schema):
    return _keras_model(dtype="int32")


def fails(schema):
    raise RuntimeError("no GPU memory left")


def wrong_third(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Two good batches, then one with a row too few: the producer refuses it and fails."""
    for seq, batch in enumerate(_batches(worker, None)):
        if seq == 2:
            yield {name: value[:-1] for name, value in batch.items()}
            return
        yield batch


def raises_third(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Two good batches, then the source's own code raises: the producer fails (exit 3)."""
    for seq, batch in enumerate(_batches(worker, None)):
        if seq == 2:
            raise OSError("the data volume went away")
        yield batch
