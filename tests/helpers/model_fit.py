"""Keras builds whose output does not fit the targets (for ``tests/test_model_fit.py``)."""

from __future__ import annotations

import keras

from examples import keras_images
from stagefeed.common.schema import ArraySpec, Schema


def three_classes(schema):
    """Three classes for ``examples.keras_images``' labels in [0, 10)."""
    images = schema["images"]
    inputs = keras.Input(images.shape, dtype=images.dtype, name="images")
    x = keras_images.cast_layer(images)(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x), name="three_classes")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def ten_outputs(schema):
    """A (None, 10) output for ``tests.helpers.regression_models``' scalar targets, with MSE."""
    inputs = keras.Input((3,), name="features")
    model = keras.Model(inputs, keras.layers.Dense(10)(inputs), name="ten_outputs")
    model.compile(optimizer="sgd", loss="mse")
    return model


# The labels of examples.keras_images without their bounds: nothing to check at start.
UNBOUNDED = Schema(
    (keras_images.SCHEMA["images"], ArraySpec("labels", "int32", ())),
    keras_images.SCHEMA.batch_size,
)


def three_classes_fn(staged, schema):
    """Graph mode: three classes for labels up to 9 (TensorFlow refuses them at the step)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    pooled = tf.reduce_mean(staged["images"], axis=[1, 2])
    w = v1.get_variable("w", [3, 3], initializer=v1.zeros_initializer())
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=staged["labels"], logits=pooled @ w)
    )
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)
