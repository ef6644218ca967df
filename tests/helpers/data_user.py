"""A data source from the public API, as a user module names it: ``--source
tests.helpers.data_user:train`` (a Hugging Face dataset of 30 rows, ids 0..29, batches of 4, the
tail dropped) and ``tests.helpers.data_user:jitter`` (a transform)."""

from __future__ import annotations

import numpy as np

import stagefeed
from tests.helpers import hf_packages

datasets = hf_packages.use()

ROWS = 30
DATASET = datasets.Dataset.from_dict({
    "id": np.arange(ROWS, dtype=np.int64),
    "x": np.arange(ROWS * 2, dtype=np.float32).reshape(ROWS, 2),
    "text": [f"row {i}" for i in range(ROWS)],
})  # fmt: skip


def jitter(record, rng):
    """The id, and ``x`` plus noise from the record's own generator."""
    return {"id": record["id"], "x": (record["x"] + rng.normal(size=2)).astype(np.float32)}


train = stagefeed.MapSource(stagefeed.HFRecords(DATASET), seed=3, short_batch="drop",
                            transform=jitter)  # fmt: skip
