"""The schema's ``cast`` and ``scale``, applied where the caller runs it: graph mode inside the
step on the training device, the TF 2 pipeline on the host or inside a step (docs/schema.md).

One implementation for every trainer; Keras models that take the wire dtype use
``stagefeed.consumer.keras_fit.callback.cast_layer``, the same arithmetic as a built-in layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import tensorflow as tf

from stagefeed.common.schema import Schema


def cast_arrays(schema: Schema, batch: Mapping[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    """Each array's declared ``cast`` then ``scale`` (``x.astype(cast) * scale``); others as is.

    ``batch`` may hold a subset of the schema's arrays.
    """
    out = dict(batch)
    for spec in schema.arrays:
        if spec.name not in out or (spec.cast is None and spec.scale is None):
            continue
        value = out[spec.name]
        if spec.cast is not None:
            value = tf.cast(value, spec.cast)
        if spec.scale is not None:
            value = value * tf.constant(spec.scale, value.dtype)
        out[spec.name] = value
    return out
