"""A ``--model`` for ``images:DIR`` runs in the tests (``tests.test_data_sources.make_images``:
12x16 RGB, two classes): the smallest Keras classifier on the derived schema."""

from __future__ import annotations

import keras


def tiny(schema):
    """Flatten and one dense layer: a step costs nothing next to starting TensorFlow."""
    model = keras.Sequential(
        [keras.Input((12, 16, 3), name="images"), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
