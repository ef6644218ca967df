"""Transforms for ``--transform tests.helpers.data_transforms:NAME`` (the data sources' tests)."""

from __future__ import annotations

import numpy as np


def crop(record, rng):
    """A random 8x8 crop of ``images``, flipped half the time; ``labels`` as they are."""
    image = record["images"]
    top, left = rng.integers(0, image.shape[0] - 7), rng.integers(0, image.shape[1] - 7)
    image = image[top : top + 8, left : left + 8]
    if rng.random() < 0.5:
        image = image[:, ::-1]
    return {"images": np.ascontiguousarray(image), "labels": record["labels"]}
