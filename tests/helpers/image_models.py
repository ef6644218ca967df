"""``--model``s on images for the tests: ``tiny`` for ``images:DIR`` runs
(``tests.test_data_sources.make_images``: 12x16 RGB, two classes), the smallest Keras
classifier on the derived schema; ``paced_fn`` for the intake tests' trainers on the seed's
schema (tests/helpers/procs.py), a graph step of known length at almost no CPU."""

from __future__ import annotations

from tests.helpers.regression_models import sleeping_step


def tiny(schema):
    """Flatten and one dense layer: a step costs nothing next to starting TensorFlow."""
    import keras

    model = keras.Sequential(
        [keras.Input((12, 16, 3), name="images"), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


PACED_STEP_S = 0.3


def paced_fn(staged, schema):
    """Graph mode on the seed's image schema: each image's mean colour through one dense layer
    to the classes, and a step that sleeps ``PACED_STEP_S``. The intake tests' trainers took
    AlexNet's steps until stopped (0.11 s of CPU a step of 2 images, the machine's load
    deciding their pace); this one takes at most 1 / PACED_STEP_S batches a second, whatever
    the load, so producers at 4 a second keep its queue full, and costs next to nothing."""
    import tensorflow as tf

    v1 = tf.compat.v1
    classes = schema["labels"].bounds[1]
    colours = tf.reduce_mean(staged["images"], axis=[1, 2])
    weights = v1.get_variable("w", [3, classes], initializer=v1.zeros_initializer())
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=staged["labels"], logits=colours @ weights))  # fmt: skip
    train_op = v1.train.GradientDescentOptimizer(0.01).minimize(loss)
    return sleeping_step(loss, train_op, PACED_STEP_S)
