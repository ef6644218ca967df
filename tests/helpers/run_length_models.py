"""A slow source with passes and models that count each row: the run's length and "finished"
decided by what was planned and trained (``tests/test_run_length_passes.py``).

``--schema tests.helpers.run_length_models:SCHEMA --source
tests.helpers.run_length_models:slow_rows``: shard ``i`` of ``n`` carries rows ``i, i+n, ...``,
one pass per call (``passes = True``, seekable), ``PER_PASS`` batches a pass over all shards,
each batch after a sleep of 0.02-0.15 s (producers slower than the trainer: the data's end
reaches the trainer after its last step). ``fast_rows``: the same rows without the sleep.
Graph mode ``--model tests.helpers.run_length_models:row_counter``, Keras ``--model
tests.helpers.run_length_models:keras_counter``: ``row_counts[ROWS]`` += the rows of every
trained batch; after E passes every count is E.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from stagefeed.common.schema import ArraySpec, Schema
from tests.helpers import row_counters

ROWS = 192
BATCH = 4
PER_PASS = ROWS // BATCH  # 48 batches a pass over all shards
SCHEMA = Schema(
    (ArraySpec("ids", "int32", bounds=(0, ROWS)), ArraySpec("x", "float32")), BATCH
)
COUNTS = row_counters.COUNTS


def _pass(worker, sleep: bool) -> Iterator[dict[str, np.ndarray]]:
    mine = np.arange(ROWS, dtype=np.int32)[worker.index :: worker.count]
    rng = np.random.default_rng(1000 * worker.epoch + worker.index)
    for k in range(worker.start, len(mine) // BATCH):
        if sleep:
            time.sleep(float(rng.uniform(0.02, 0.15)))
        yield {"ids": mine[k * BATCH : (k + 1) * BATCH].copy(), "x": np.ones(BATCH, np.float32)}


def slow_rows(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Pass ``worker.epoch`` of the shard from its batch ``worker.start``, slowly."""
    return _pass(worker, sleep=True)


def fast_rows(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """Pass ``worker.epoch`` of the shard from its batch ``worker.start``."""
    return _pass(worker, sleep=False)


for _source in (slow_rows, fast_rows):
    _source.passes = True  # type: ignore[attr-defined]
    _source.seekable = True  # type: ignore[attr-defined]


def row_counter(staged, schema):
    """Graph mode: ``row_counts[ROWS]`` += one-hot of the batch's row ids; loss 0."""
    return row_counters.graph_row_counter(staged, ROWS)


def graph_counts(prefix: str) -> np.ndarray:
    """``row_counts`` of a graph checkpoint (``DIR/model.ckpt``)."""
    return row_counters.graph_counts(prefix)


def keras_counter(schema):
    """Keras: ``row_counts`` (non-trainable) += one-hot of the ids in training calls, and a
    scalar ``w`` fit to ``x`` (ones) by SGD."""
    import keras

    return row_counters.keras_row_counter("run_length_counter", ROWS, keras.optimizers.SGD(0.01))


def keras_counts(path: str) -> np.ndarray:
    """``row_counts`` of a ``.keras`` file of ``keras_counter``."""
    return row_counters.keras_counts(keras_counter(SCHEMA), path)
