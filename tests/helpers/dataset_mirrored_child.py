"""Child process of test_dataset_mirrored: the TF 2 feed under MirroredStrategy on 2 logical CPUs.

Logical devices must be configured before TensorFlow initialises its devices, hence a fresh
process: ``python -m tests.helpers.dataset_mirrored_child``. Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import gc
import itertools
import json

import numpy as np
import tensorflow as tf

CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402 - after the device configuration

from examples import custom_loop  # noqa: E402
from examples.filler import ThreadFiller  # noqa: E402
from stagefeed.common.schema import ArraySpec, Schema  # noqa: E402
from stagefeed.consumer.tf2.feed import Feed  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

MARKED = Schema((ArraySpec("marker", "int64", ()), ArraySpec("x", "float32", (4,))), 8)
FILL_WAIT_S = 60
WEIGHTS = np.array([1.0, -1.0, 2.0, 0.5], np.float32)


def marked(seed: int = 0):
    rng = np.random.default_rng(seed)
    for seq in itertools.count():
        x = rng.normal(size=(8, 4)).astype(np.float32)
        yield {"marker": np.full(8, seq, np.int64), "x": x}


def balanced(figures) -> bool:
    return figures.enqueued == figures.trained + figures.abandoned + figures.queued


def replicas_see_what_the_books_say(strategy: tf.distribute.Strategy) -> dict:
    """Each replica reports the seq of the batch it got; the books must name the same ones."""
    with strategy.scope():
        feed = Feed(MARKED, 8, stage_depth=2)  # created inside a strategy scope on purpose
    steps: list[dict] = []

    @tf.function
    def step(iterator):
        return strategy.run(lambda batch: batch["marker"][0], args=(next(iterator),))

    with ThreadFiller(feed, marked()):
        with strategy.scope():
            iterator = iter(feed.dataset())  # distributed by the strategy in scope
        element = next(iterator)
        devices = [v.device for v in element["marker"].values]
        feed.books.step_done()
        for _ in range(4):
            seen = [int(v) for v in strategy.experimental_local_results(step(iterator))]
            _, seqs = feed.books.step_done()
            steps.append({"seen": seen, "booked": seqs})
        # The buffers have pulled what they hold ahead, with the queue behind them full: the
        # filler never stops, so they had all they could take.
        filled = wait_for(
            lambda: feed.figures().in_queue == 8 and feed.figures().in_flight >= 2, FILL_WAIT_S
        )
        ahead = feed.figures().in_flight
        feed.books.end()
        del iterator
    gc.collect()
    figures = feed.figures()
    return {
        "devices": devices,
        "steps": steps,
        "ahead": ahead,
        "filled": filled,
        "per_step": feed.books.batches_per_step,
        "balanced": balanced(figures),
        "trained": figures.trained,
    }


def fit_under_mirrored(strategy: tf.distribute.Strategy) -> dict:
    schema = Schema((ArraySpec("x", "float32", (4,)), ArraySpec("y", "int32", ())), 8)
    rng = np.random.default_rng(1)

    def separable():
        while True:
            x = rng.normal(size=(8, 4)).astype(np.float32)
            yield {"x": x, "y": (x @ WEIGHTS > 0).astype(np.int32)}

    feed = Feed(schema, 8, stage_depth=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(
            keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    with ThreadFiller(feed, separable()):
        history = model.fit(
            feed.dataset(("x", "y"), strategy=strategy),
            steps_per_epoch=4,
            epochs=3,
            callbacks=[feed.callback()],
            shuffle=False,
            verbose=0,
        ).history
    gc.collect()
    figures = feed.figures()
    return {
        "loss": history["loss"],
        "trained_history": history["stagefeed_trained"],
        "balanced": balanced(figures),
        "abandoned": figures.abandoned,
    }


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    loop = custom_loop.train(steps=20, strategy=strategy)
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "books": replicas_see_what_the_books_say(strategy),
        "custom_loop": {
            "losses": loop.losses,
            "replicas": loop.replicas,
            "trained": loop.feed.figures().trained,
            "balanced": balanced(loop.feed.figures()),
        },
        "fit": fit_under_mirrored(strategy),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
