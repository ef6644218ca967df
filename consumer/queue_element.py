"""What one FIFOQueue element holds, in graph mode and in the TF 2 feed alike: the schema's
arrays in wire order, then the connection index (int32) and the sequence number (int64) of
the message they came in, so every trained batch traces back to its producer."""

from __future__ import annotations

import tensorflow as tf

from stagefeed.common.schema import Schema

PEER_DTYPE = tf.int32
SEQ_DTYPE = tf.int64


def queue_element(schema: Schema) -> tuple[list[tf.DType], list[list[int]]]:
    """(dtypes, shapes) of the queue's components, the arrays' first."""
    wire = schema.wire()
    dtypes = [tf.as_dtype(dtype) for _, dtype, _ in wire] + [PEER_DTYPE, SEQ_DTYPE]
    shapes = [list(shape) for _, _, shape in wire] + [[], []]
    return dtypes, shapes
