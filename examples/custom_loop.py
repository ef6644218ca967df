"""A custom ``tf.function`` training loop over a feed, under any ``tf.distribute`` strategy.

Batches: float32 ``features`` [B, 32], int64 token ``ids`` [B, 20] in [0, 1000), float32
``targets`` [B]. The model embeds the ids, averages them, joins the features and regresses the
target. Each replica trains on whole queue batches; ``feed.books.step_done()`` books them.

    python -m examples.custom_loop
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import keras
import numpy as np
import tensorflow as tf

from examples.filler import ThreadFiller
from stagefeed import ArraySpec, Feed, Schema

log = logging.getLogger(__name__)

VOCABULARY = 1000
SCHEMA = Schema(
    (
        ArraySpec("features", "float32", (32,)),
        ArraySpec("ids", "int64", (20,), bounds=(0, VOCABULARY)),
        ArraySpec("targets", "float32", ()),
    ),
    batch_size=32,
)


def user_batches(schema: Schema = SCHEMA, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of a learnable target: linear in the features plus a per-token value."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=32).astype(np.float32) / 4
    token_value = rng.uniform(-1, 1, size=VOCABULARY).astype(np.float32)
    size = schema.batch_size
    while True:
        features = rng.normal(size=(size, 32)).astype(np.float32)
        ids = rng.integers(0, VOCABULARY, size=(size, 20), dtype=np.int64)
        targets = features @ weights + token_value[ids].mean(axis=1) * 4
        yield {"features": features, "ids": ids, "targets": targets.astype(np.float32)}


def build_model() -> keras.Model:
    features = keras.Input((32,), name="features")
    ids = keras.Input((20,), dtype="int64", name="ids")
    tokens = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCABULARY, 8)(ids))
    x = keras.layers.Concatenate()([features, tokens])
    x = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model([features, ids], keras.layers.Dense(1)(x), name="regressor")


@dataclasses.dataclass
class Trained:
    losses: list[float]
    feed: Feed  # closed; ask it for the books
    replicas: int


def train(
    steps: int = 30, strategy: tf.distribute.Strategy | None = None, seed: int = 0
) -> Trained:
    """``steps`` steps of mean squared error; each step trains one batch per replica."""
    strategy = strategy or tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    global_batch = SCHEMA.batch_size * replicas
    feed = Feed(SCHEMA, capacity=8, stage_depth=2)
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.Adam(0.01)
        # Built here, not lazily inside the replicated tf.function: under MirroredStrategy a
        # lazy build fails with "You must feed a value for placeholder tensor" (Keras 3.15).
        optimizer.build(model.trainable_variables)

    def replica_step(batch: dict[str, tf.Tensor]) -> tf.Tensor:
        with tf.GradientTape() as tape:
            predicted = model([batch["features"], batch["ids"]], training=True)[:, 0]
            per_example = tf.square(predicted - batch["targets"])
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(iterator: Iterator) -> tf.Tensor:
        losses = strategy.run(replica_step, args=(next(iterator),))
        return strategy.reduce("SUM", losses, axis=None)

    losses = []
    with ThreadFiller(feed, user_batches(seed=seed)):
        iterator = iter(feed.dataset(strategy=strategy))
        feed.books.begin()
        for _ in range(steps):
            losses.append(float(train_step(iterator)))
            feed.books.step_done()
        feed.books.end()
    return Trained(losses, feed, replicas)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = train()
    log.info("loss: first %.3f, last %.3f", result.losses[0], result.losses[-1])
    log.info("books: %s", result.feed.figures())


if __name__ == "__main__":
    main()
