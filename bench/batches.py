"""Numpy batches of a schema, made once before anything is timed. No TensorFlow here: the raw
pyzmq sender processes import this module."""

from __future__ import annotations

import numpy as np

from stagefeed.common.schema import Schema


def host_batch(schema: Schema, seed: int = 0) -> dict[str, np.ndarray]:
    """One batch like the seed's ``get_numpy_batch``: ordinary (unaligned) arrays, by name in
    the schema's order. ``uint8`` images span [0, 256), ``float32`` ones [0, 1), labels the
    class range (``schema["labels"].bounds``); drawn in that order from one generator.
    """
    rng = np.random.default_rng(seed)
    images, labels = schema["images"], schema["labels"]
    if images.dtype == "uint8":
        pixels = rng.integers(0, 256, size=schema.batch_shape(images), dtype=np.uint8)
    else:
        pixels = rng.random(schema.batch_shape(images), dtype=np.float32)
    low, high = labels.bounds  # set by image_schema; bench.config checks it
    classes = rng.integers(low, high, size=schema.batch_shape(labels), dtype=np.int32)
    return {"images": pixels, "labels": classes}
