"""The Keras model of ``bench steps``' Keras trio: the seed's AlexNet, layer for layer, in Keras 3.

The same network as ``consumer.graph.alexnet`` (which the graph modes train), so the Keras table and
the graph table time the same arithmetic: VALID convolutions with bias and Glorot-uniform
kernels and *no activation* (the seed passed none), VALID 3x3/2 max-pooling, two ReLU dense
layers of 4096 with truncated-normal(stddev=1.0) kernels, a linear output of the labels' class
count, sparse softmax cross-entropy on the logits, SGD with learning rate 0.01 on gradients
clipped to a global norm of ``consumer.graph.alexnet.CLIP_NORM`` (the graph model's one departure
from
the seed), no dropout (the seed's dropout ran with ``training=False``). Images enter in their
wire dtype; a uint8 schema's cast and scale is the model's first layer
(``consumer.keras_fit.callback.cast_layer``), so it runs in the step on the training device, for
every
mode alike.

``jit_compile=False``: the graph modes run without XLA, and Keras' ``"auto"`` would turn XLA on
for this model; the choice is the same for all three modes.
"""

from __future__ import annotations

import keras

from stagefeed.common.schema import Schema
from stagefeed.consumer.graph import alexnet as graph_model
from stagefeed.consumer.keras_fit.callback import cast_layer

LEARNING_RATE = graph_model.LEARNING_RATE
CLIP_NORM = graph_model.CLIP_NORM


def _conv(filters: int, kernel: int, stride: int, name: str) -> keras.layers.Layer:
    return keras.layers.Conv2D(
        filters, kernel, strides=stride, padding="valid", kernel_initializer="glorot_uniform",
        name=name,
    )  # fmt: skip


def _pool(name: str) -> keras.layers.Layer:
    return keras.layers.MaxPooling2D(3, 2, padding="valid", name=name)


def _dense(units: int, name: str) -> keras.layers.Layer:
    normal = keras.initializers.TruncatedNormal(stddev=1.0)
    return keras.layers.Dense(units, activation="relu", kernel_initializer=normal, name=name)


def alexnet_layers(schema: Schema) -> tuple[keras.KerasTensor, keras.KerasTensor]:
    """(inputs, logits) of the functional AlexNet on ``schema``'s ``images`` (wire dtype)."""
    graph_model.check_schema(schema)  # float32 (or cast to it), at least 195x195, int32 labels
    images = schema["images"]
    inputs = keras.Input(images.shape, batch_size=schema.batch_size, dtype=images.dtype,
                         name="images")  # fmt: skip
    x = inputs
    if images.cast is not None or images.scale is not None:
        x = cast_layer(images)(x)
    x = _pool("pool1")(_conv(64, 11, 4, "conv1")(x))
    x = _pool("pool2")(_conv(192, 5, 1, "conv2")(x))
    x = _conv(384, 3, 1, "conv3")(x)
    x = _conv(384, 3, 1, "conv4")(x)
    x = _pool("pool5")(_conv(256, 3, 1, "conv5")(x))
    x = keras.layers.Flatten(name="flatten")(x)
    x = _dense(4096, "fc6")(x)
    x = _dense(4096, "fc7")(x)
    classes = schema["labels"].bounds[1]
    logits = keras.layers.Dense(classes, kernel_initializer="glorot_uniform", name="fc8")(x)
    return inputs, logits


def compile_model(model: keras.Model) -> keras.Model:
    """SGD 0.01 on clipped gradients, sparse softmax cross-entropy, no metrics, no XLA (see the
    module doc)."""
    model.compile(
        optimizer=keras.optimizers.SGD(LEARNING_RATE, global_clipnorm=CLIP_NORM),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def alexnet(schema: Schema) -> keras.Model:
    """The compiled Keras AlexNet every Keras mode but ``keras-synthetic`` trains."""
    inputs, logits = alexnet_layers(schema)
    return compile_model(keras.Model(inputs, logits, name="alexnet"))
