"""A batch that is not images: float32 features [B,32], int64 token ids [B,20], float32 targets [B].

Everything a user writes for stagefeed, in one module:

- ``SCHEMA``: the batch (the same as ``examples/three_arrays.toml``);
- ``batches(schema, worker)``: the producer's source, a generator of dicts of arrays; each
  worker draws from its own seed, and the targets are a learnable function of the inputs;
- ``model_fn(staged, schema)``: a graph-mode model, an embedding of the ids plus a linear map
  of the features, trained to regress the targets.

Over the command line::

    stagefeed train --bind tcp://127.0.0.1:5555 --schema examples/three_arrays.toml \\
        --model examples.three_arrays:model_fn --steps 20
    stagefeed produce --connect tcp://127.0.0.1:5555 --source examples.three_arrays:batches
"""

from __future__ import annotations

import numpy as np

from stagefeed import ArraySpec, Schema

VOCAB = 1000
SCHEMA = Schema(
    (
        ArraySpec("features", "float32", (32,)),
        ArraySpec("token_ids", "int64", (20,), bounds=(0, VOCAB)),
        ArraySpec("targets", "float32"),
    ),
    batch_size=64,
)


def batches(schema: Schema, worker):
    """Endless batches; the target is ``features.sum() / 8 + mean token id / VOCAB``."""
    rng = np.random.default_rng(worker.seed)
    size = schema.batch_size
    while True:
        features = rng.standard_normal((size, 32), dtype=np.float32)
        ids = rng.integers(0, VOCAB, size=(size, 20), dtype=np.int64)
        targets = (features.sum(1) / 8 + ids.mean(1) / VOCAB).astype(np.float32)
        yield {"features": features, "token_ids": ids, "targets": targets}


def model_fn(staged, schema):
    """(loss, train op) on the staged arrays: graph mode (tf.compat.v1 variables)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    embedding = v1.get_variable("embedding", [VOCAB, 8], initializer=v1.zeros_initializer())
    w_ids = v1.get_variable("w_ids", [8, 1], initializer=v1.zeros_initializer())
    w_features = v1.get_variable("w_features", [32, 1], initializer=v1.zeros_initializer())
    pooled = tf.reduce_mean(tf.nn.embedding_lookup(embedding, staged["token_ids"]), axis=1)
    prediction = tf.squeeze(staged["features"] @ w_features + pooled @ w_ids, axis=1)
    loss = tf.reduce_mean(tf.square(prediction - staged["targets"]))
    return loss, v1.train.AdamOptimizer(0.05).minimize(loss)
