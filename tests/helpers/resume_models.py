"""A model whose only state counts how often each row was trained, and a finite, sharded,
seekable source of those rows: ``tests/test_resume.py`` kills runs and checks every count.

``--schema tests.helpers.resume_models:SCHEMA --source tests.helpers.resume_models:rows``;
graph mode ``--model tests.helpers.resume_models:row_counter``, Keras ``--model
tests.helpers.resume_models:keras_counter``.
``ROWS`` rows, ``BATCH`` to a batch, ``EPOCHS`` passes: shard ``i`` of ``n`` carries rows
``i, i+n, ...``, and its stream is its batches, pass after pass (batch ``k`` of the stream is
``k % per_pass`` of pass ``k // per_pass``). After a complete run every count is ``EPOCHS``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.producer.data.arrays import ArrayRecords
from stagefeed.producer.data.source import MapSource
from tests.helpers import row_counters

ROWS = 96
BATCH = 4
EPOCHS = 2
SCHEMA = Schema(
    (ArraySpec("ids", "int32", bounds=(0, ROWS)), ArraySpec("x", "float32")), BATCH
)
COUNTS = row_counters.COUNTS


def stream(index: int, count: int) -> list[np.ndarray]:
    """Shard ``index`` of ``count``: its batches of row ids, every pass (the whole stream)."""
    mine = np.arange(ROWS, dtype=np.int32)[index::count]
    per_pass = [mine[k : k + BATCH] for k in range(0, len(mine) - BATCH + 1, BATCH)]
    return per_pass * EPOCHS


def miscounted(counts: np.ndarray) -> dict[int, float]:
    """The rows not trained exactly ``EPOCHS`` times, with their counts (empty: every row was;
    the message of a failed check)."""
    assert counts.shape == (ROWS,), counts.shape
    return {int(i): float(counts[i]) for i in np.flatnonzero(counts != EPOCHS)}


def rows(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The shard's stream from batch ``worker.start`` on (seekable)."""
    for ids in stream(worker.index, worker.count)[worker.start :]:
        yield {"ids": ids.copy(), "x": np.ones(BATCH, np.float32)}


rows.seekable = True  # type: ignore[attr-defined]


# The same rows as a user's data: a MapSource shuffled with a seed, its EPOCHS epochs as one
# stream (no passes: what a cluster's workers take), so a checkpoint of one shard count
# resumes at another (docs/resume.md, "Another producer count").
mapped = MapSource(
    ArrayRecords({"ids": np.arange(ROWS, dtype=np.int32), "x": np.ones(ROWS, np.float32)}),
    seed=7, epochs=EPOCHS, name="resume_models rows",
)


def rows_unseekable(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The same stream, always from its first batch (the producer fast-forwards it)."""
    for ids in stream(worker.index, worker.count):
        yield {"ids": ids.copy(), "x": np.ones(BATCH, np.float32)}


def row_counter(staged, schema):
    """Graph mode: ``row_counts[ROWS]`` += one-hot of the batch's row ids; loss 0."""
    return row_counters.graph_row_counter(staged, ROWS)


def counts_in(prefix: str) -> np.ndarray:
    """``row_counts`` of a graph checkpoint (``DIR/model.ckpt``)."""
    return row_counters.graph_counts(prefix)


LEARNING_RATE = 0.05


def keras_counter(schema):
    """Keras: the ``counter`` layer (``row_counts[ROWS]`` += one-hot of the row ids, in
    training calls only) and one trainable scalar ``w`` fit to the target ``x`` (ones) by
    Adam: ``w`` after ``n`` steps depends on ``n`` and on Adam's moments and ``iterations``
    going on unbroken across restarts (``keras_reference_w``)."""
    import keras

    return row_counters.keras_row_counter(
        "keras_counter", ROWS, keras.optimizers.Adam(LEARNING_RATE)
    )


def keras_state_in(path: str) -> tuple[np.ndarray, float, int]:
    """``(row_counts, w, optimizer iterations)`` of a ``.keras`` file of ``keras_counter``."""
    model = keras_counter(SCHEMA)
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    layer = model.get_layer("counter")
    return layer.counts.numpy(), float(layer.w.numpy()), int(model.optimizer.iterations)


def keras_reference_w(steps: int) -> float:
    """``w`` of ``keras_counter`` after ``steps`` steps of one uninterrupted ``fit``."""
    import tensorflow as tf

    model = keras_counter(SCHEMA)
    ids = np.zeros(steps * BATCH, np.int32)
    data = tf.data.Dataset.from_tensor_slices((ids, np.ones(steps * BATCH, np.float32)))
    model.fit(data.batch(BATCH), epochs=1, verbose=0, shuffle=False)
    return float(model.get_layer("counter").w.numpy())
