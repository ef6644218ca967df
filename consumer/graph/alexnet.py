"""The seed's AlexNet, rebuilt from ``tf.nn`` ops (``tf.layers`` is gone under Keras 3).

Layer for layer the same as the seed's ``Model``: ``tf.layers.conv2d`` defaults (stride 1 unless
given, VALID padding, bias, Glorot-uniform kernels, *no activation*: the seed passed none),
VALID max-pooling, dense layers with ReLU and truncated-normal(stddev=1.0) kernels, a linear
1000-way output, sparse softmax cross-entropy and SGD with learning rate 0.01. The seed's
``tf.layers.dropout(rate=0.5)`` ran with its default ``training=False`` and so was the identity;
``dropout_active=False`` keeps that, so step times compare with the seed's table.

One departure from the seed, in the optimizer only: gradients are clipped to a global norm of
``CLIP_NORM`` before the SGD update. With the seed's stddev-1.0 dense kernels the first loss on
random images is in the hundreds and unclipped SGD reaches NaN by the third step (measured:
483.8, 2.95e14, nan at batch 2); clipped, the loss stays finite and falls (40 steps at batches
2 and 32). A NaN loss stops training (``--on-nan``), so the default model must not produce one
on the synthetic data ``make run`` trains on. Every ``bench steps`` mode trains this same step,
so its ratios are unaffected; the clip adds one global-norm reduction per step.
"""

from __future__ import annotations

import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import Schema

v1 = tf.compat.v1

LEARNING_RATE = 0.01
CLIP_NORM = 1.0


def _conv(x: tf.Tensor, filters: int, kernel: int, stride: int, name: str) -> tf.Tensor:
    with v1.variable_scope(name):
        w = v1.get_variable(
            "kernel",
            [kernel, kernel, x.shape[-1], filters],
            initializer=v1.glorot_uniform_initializer(),
        )
        b = v1.get_variable("bias", [filters], initializer=v1.zeros_initializer())
    return tf.nn.bias_add(tf.nn.conv2d(x, w, stride, "VALID"), b)


def _dense(x: tf.Tensor, units: int, name: str, relu: bool, initializer) -> tf.Tensor:
    with v1.variable_scope(name):
        w = v1.get_variable("kernel", [x.shape[-1], units], initializer=initializer)
        b = v1.get_variable("bias", [units], initializer=v1.zeros_initializer())
    y = tf.nn.bias_add(tf.matmul(x, w), b)
    return tf.nn.relu(y) if relu else y


def _pool(x: tf.Tensor) -> tf.Tensor:
    return tf.nn.max_pool2d(x, 3, 2, "VALID")


def feature_size(image_size: int) -> int:
    """Spatial size after conv5's pooling for square inputs (2 for the seed's 227)."""
    size = (image_size - 11) // 4 + 1
    for shrink in ("pool", 4, "pool", 2, 2, 2, "pool"):
        size = (size - 3) // 2 + 1 if shrink == "pool" else size - shrink
    return size


def check_image_size(height: int, width: int) -> None:
    """Raise ``ConfigError`` for images too small for the seed's VALID convolutions."""
    if min(feature_size(height), feature_size(width)) < 1:
        raise ConfigError(f"AlexNet needs images of at least 195x195 pixels, got {height}x{width}")


def inference(
    images: tf.Tensor, num_classes: int = 1000, dropout_active: bool = False
) -> tf.Tensor:
    """Logits for NHWC float32 ``images``."""
    normal = v1.truncated_normal_initializer(stddev=1.0)
    x = _pool(_conv(images, 64, 11, 4, "conv1"))
    x = _pool(_conv(x, 192, 5, 1, "conv2"))
    x = _conv(x, 384, 3, 1, "conv3")
    x = _conv(x, 384, 3, 1, "conv4")
    x = _pool(_conv(x, 256, 3, 1, "conv5"))
    x = tf.reshape(x, [tf.shape(x)[0], x.shape[1] * x.shape[2] * x.shape[3]])
    x = _dense(x, 4096, "fc6", True, normal)
    if dropout_active:
        x = tf.nn.dropout(x, rate=0.5)
    x = _dense(x, 4096, "fc7", True, normal)
    if dropout_active:
        x = tf.nn.dropout(x, rate=0.5)
    return _dense(x, num_classes, "fc8", False, v1.glorot_uniform_initializer())


def train_op(
    images: tf.Tensor, labels: tf.Tensor, num_classes: int = 1000
) -> tuple[tf.Tensor, tf.Operation]:
    """(loss, SGD train op on clipped gradients) for the seed's model; call inside the graph
    and device scope."""
    with v1.variable_scope("alexnet", reuse=v1.AUTO_REUSE):
        logits = inference(images, num_classes)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )
    optimizer = v1.train.GradientDescentOptimizer(LEARNING_RATE)
    gradients, variables = zip(*optimizer.compute_gradients(loss), strict=True)
    clipped, _ = tf.clip_by_global_norm(gradients, CLIP_NORM)
    step = optimizer.apply_gradients(zip(clipped, variables, strict=True))
    return loss, step


def check_schema(schema: Schema) -> None:
    """``ConfigError`` unless ``schema`` has what AlexNet trains on: NHWC ``images`` (float32,
    or cast to it) at least 195x195, and int32 ``labels`` bounded by the class count.
    """
    try:
        images, labels = schema["images"], schema["labels"]
    except KeyError as exc:
        raise ConfigError(f"the AlexNet model needs arrays images and labels, no {exc}") from None
    if len(images.shape) != 3 or (images.cast or images.dtype) != "float32":
        raise ConfigError(
            f"AlexNet needs images [H, W, C] float32 (or uint8 cast to float32), "
            f"got {images.dtype}{list(images.shape)}"
        )
    check_image_size(images.shape[0], images.shape[1])
    if labels.shape != () or labels.dtype != "int32" or labels.bounds is None:
        raise ConfigError("AlexNet needs int32 labels [B] with bounds [0, num_classes)")


def model_fn(staged: dict[str, tf.Tensor], schema: Schema) -> tuple[tf.Tensor, tf.Operation]:
    """The default graph-mode step: the seed's AlexNet on the staged (already cast) batch."""
    check_schema(schema)
    return train_op(staged["images"], staged["labels"], schema["labels"].bounds[1])
