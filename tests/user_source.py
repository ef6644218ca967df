"""A user-supplied source for ``--source tests.user_source:batches`` (used by the tests)."""

from __future__ import annotations

import numpy as np
from stagefeed.common.spec import BatchSpec


def batches(spec: BatchSpec, worker_index: int):
    """Batches whose every label is the worker index, so the test can tell sources apart."""
    images = np.zeros(spec.image_shape, dtype=spec.image_dtype)
    while True:
        yield {"images": images, "labels": np.full(spec.label_shape, worker_index, np.int32)}


def wrong_shape(spec: BatchSpec, worker_index: int):
    yield {
        "images": np.zeros((1, 2, 3), np.float32),
        "labels": np.zeros(spec.label_shape, np.int32),
    }
