"""The AlexNet train op matches the seed's model layer for layer."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.consumer.graph import alexnet

v1 = tf.compat.v1


def _seed_reference_shapes():
    """The seed's tf.layers stack rebuilt with Keras layers (same defaults: VALID, stride 1)."""
    keras = tf.keras
    layers = [
        keras.Input((227, 227, 3)),
        keras.layers.Conv2D(64, 11, 4, padding="valid"),
        keras.layers.MaxPooling2D(3, 2),
        keras.layers.Conv2D(192, 5),
        keras.layers.MaxPooling2D(3, 2),
        keras.layers.Conv2D(384, 3),
        keras.layers.Conv2D(384, 3),
        keras.layers.Conv2D(256, 3),
        keras.layers.MaxPooling2D(3, 2),
        keras.layers.Flatten(),
        keras.layers.Dense(4096, "relu"),
        keras.layers.Dense(4096, "relu"),
        keras.layers.Dense(1000),
    ]
    reference = keras.Sequential(layers)
    return [tuple(w.shape) for w in reference.weights]


def test_variables_match_the_seed_model():
    graph = tf.Graph()
    with graph.as_default():
        images = v1.placeholder(tf.float32, [2, 227, 227, 3])
        labels = v1.placeholder(tf.int32, [2])
        alexnet.train_op(images, labels)
        ours = [tuple(v.shape.as_list()) for v in v1.trainable_variables()]
    assert ours == _seed_reference_shapes()
    # 2x2x256 features after conv5: the seed pads nothing.
    assert sum(int(np.prod(s)) for s in ours) == 28_283_816


def test_the_loss_stays_finite_on_random_images_where_the_seed_diverged():
    """Unclipped, the seed's SGD gave 483.8, 2.95e14, then NaN on these batches of 2."""
    graph = tf.Graph()
    with graph.as_default():
        images = v1.placeholder(tf.float32, [2, 227, 227, 3])
        labels = v1.placeholder(tf.int32, [2])
        loss, step = alexnet.train_op(images, labels)
        rng = np.random.default_rng(0)
        losses = []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(8):
                feed = {images: rng.random((2, 227, 227, 3), dtype=np.float32),
                        labels: rng.integers(0, 1000, 2)}  # fmt: skip
                losses.append(sess.run([loss, step], feed)[0])
            again = sess.run(loss, feed)
    assert np.isfinite(losses).all(), losses
    assert again != losses[-1]  # SGD changed the weights


def test_uint8_images_are_scaled_to_unit_range():
    from stagefeed.common.schema import image_schema
    from stagefeed.consumer.cast import cast_arrays

    schema = image_schema(batch_size=1, dtype="uint8")
    staged = {"images": tf.constant([[0, 255]], dtype=tf.uint8), "labels": tf.constant([1])}
    assert cast_arrays(schema, staged)["images"].numpy().tolist() == [[0.0, 1.0]]


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ("three", "images"),
        ("small", "194x194"),
        ("unbounded", "bounds"),
    ],
)
def test_alexnet_refuses_a_schema_it_cannot_train_naming_why(schema, named):
    from stagefeed.common.schema import ArraySpec, Schema, image_schema

    schemas = {
        "three": Schema((ArraySpec("features", "float32", (32,)),), 4),
        "small": image_schema(batch_size=2, image_size=194),
        "unbounded": Schema(
            (ArraySpec("images", "float32", (227, 227, 3)), ArraySpec("labels", "int32")), 2
        ),
    }
    with pytest.raises(ConfigError, match=named):
        alexnet.check_schema(schemas[schema])


def test_too_small_images_fail_naming_the_size():
    assert alexnet.feature_size(227) == 2 and alexnet.feature_size(195) == 1
    with pytest.raises(ConfigError, match="194x194"):
        alexnet.check_image_size(194, 194)
