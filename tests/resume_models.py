"""A model whose only state counts how often each row was trained, and a finite, sharded,
seekable source of those rows: ``tests/test_resume.py`` kills runs and checks every count.

``--schema tests.resume_models:SCHEMA --source tests.resume_models:rows``; graph mode
``--model tests.resume_models:row_counter``, Keras ``--model tests.resume_models:keras_counter``.
``ROWS`` rows, ``BATCH`` to a batch, ``EPOCHS`` passes: shard ``i`` of ``n`` carries rows
``i, i+n, ...``, and its stream is its batches, pass after pass (batch ``k`` of the stream is
``k % per_pass`` of pass ``k // per_pass``). After a complete run every count is ``EPOCHS``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from stagefeed.common.schema import ArraySpec, Schema

ROWS = 96
BATCH = 4
EPOCHS = 2
SCHEMA = Schema(
    (ArraySpec("ids", "int32", bounds=(0, ROWS)), ArraySpec("x", "float32")), BATCH
)
COUNTS = "row_counts"


def stream(index: int, count: int) -> list[np.ndarray]:
    """Shard ``index`` of ``count``: its batches of row ids, every pass (the whole stream)."""
    mine = np.arange(ROWS, dtype=np.int32)[index::count]
    per_pass = [mine[k : k + BATCH] for k in range(0, len(mine) - BATCH + 1, BATCH)]
    return per_pass * EPOCHS


def rows(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The shard's stream from batch ``worker.start`` on (seekable)."""
    for ids in stream(worker.index, worker.count)[worker.start :]:
        yield {"ids": ids.copy(), "x": np.ones(BATCH, np.float32)}


rows.seekable = True  # type: ignore[attr-defined]


def rows_unseekable(schema, worker) -> Iterator[dict[str, np.ndarray]]:
    """The same stream, always from its first batch (the producer fast-forwards it)."""
    for ids in stream(worker.index, worker.count):
        yield {"ids": ids.copy(), "x": np.ones(BATCH, np.float32)}


def row_counter(staged, schema):
    """Graph mode: ``row_counts[ROWS]`` += one-hot of the batch's row ids; loss 0."""
    import tensorflow as tf

    v1 = tf.compat.v1
    counts = v1.get_variable(COUNTS, [ROWS], tf.float32, v1.zeros_initializer(), trainable=False)
    ids = tf.cast(staged["ids"], tf.int32)
    add = counts.assign_add(tf.reduce_sum(tf.one_hot(ids, ROWS), axis=0))
    loss = tf.reduce_sum(staged["x"]) * 0.0
    return loss, tf.group(add)


def counts_in(prefix: str) -> np.ndarray:
    """``row_counts`` of a graph checkpoint (``DIR/model.ckpt``)."""
    import tensorflow as tf

    return tf.train.load_checkpoint(prefix).get_tensor(COUNTS)
