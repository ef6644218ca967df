"""Keras 3 ``model.fit`` on the TF 2 feed: learning, per-step books in the logs, clean end."""

from __future__ import annotations

import contextlib
import gc
import itertools
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from examples.filler import ThreadFiller
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.tf2.feed import Feed

SCHEMA = Schema((ArraySpec("x", "float32", (4,)), ArraySpec("y", "int32", (), bounds=(0, 2))), 16)
WEIGHTS = np.array([1.0, -1.0, 2.0, 0.5], np.float32)


class RecordingSink:
    def __init__(self) -> None:
        self.trained_seqs: list[int] = []
        self.abandoned_seqs: list[int] = []

    def trained(self, peers: list[int], seqs: list[int]) -> None:
        self.trained_seqs.extend(seqs)

    def abandoned(self, peers: list[int], seqs: list[int]) -> None:
        self.abandoned_seqs.extend(seqs)


def separable(count: int | None = None, seed: int = 0):
    """Linearly separable batches: a logistic regression learns them in a few steps."""
    rng = np.random.default_rng(seed)
    for _ in itertools.count() if count is None else range(count):
        x = rng.normal(size=(16, 4)).astype(np.float32)
        yield {"x": x, "y": (x @ WEIGHTS > 0).astype(np.int32)}


def compiled(strategy: tf.distribute.Strategy | None = None, **compile_args) -> keras.Model:
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(
            keras.optimizers.SGD(0.5),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **compile_args,
        )
    return model


def settled(feed: Feed):
    """Books once every iterator is gone and the feed closed: nothing moves any more."""
    gc.collect()  # Keras' epoch iterator sits in a reference cycle
    feed.close()
    figures = feed.figures()
    assert figures.enqueued == figures.trained + figures.abandoned + figures.queued
    assert figures.unaccounted == figures.unbooked == 0
    return figures


def test_fit_learns_and_books_every_step_in_order_with_figures_in_history():
    sink = RecordingSink()
    feed = Feed(SCHEMA, 8, stage_depth=2, sink=sink)
    with ThreadFiller(feed, separable()):
        model = compiled()
        history = model.fit(
            feed.dataset(("x", "y")),
            steps_per_epoch=5,
            epochs=3,
            callbacks=[feed.callback()],
            shuffle=False,
        ).history
    losses = history["loss"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert history["stagefeed_trained"] == [5.0, 10.0, 15.0]
    assert all(
        0.0 <= v <= 1.0 for v in history["stagefeed_queue_fill"] + history["stagefeed_input_wait"]
    )
    assert sink.trained_seqs == list(range(15))
    figures = settled(feed)
    assert figures.trained == 15 and figures.abandoned == len(sink.abandoned_seqs)


def test_fit_under_a_strategy_books_the_batches_keras_discards_before_training():
    sink = RecordingSink()
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    feed = Feed(SCHEMA, 8, stage_depth=1, sink=sink)
    with ThreadFiller(feed, separable()):
        model = compiled(strategy)
        history = model.fit(
            feed.dataset(("x", "y"), strategy=strategy),
            steps_per_epoch=4,
            epochs=2,
            callbacks=[feed.callback()],
            shuffle=False,
        ).history
    # Keras 3 draws a batch from a throwaway iterator to build the model under a strategy.
    first_abandoned = int(history["stagefeed_abandoned"][0])
    assert first_abandoned >= 1 and sink.abandoned_seqs[:first_abandoned] == list(
        range(first_abandoned)
    )
    assert sink.trained_seqs == list(range(first_abandoned, first_abandoned + 8))
    assert math.isfinite(history["loss"][-1])
    assert settled(feed).trained == 8


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_a_finite_source_ends_fit_after_its_last_batch_with_nothing_lost():
    feed = Feed(SCHEMA, 4, stage_depth=2)
    with ThreadFiller(feed, separable(count=12), close_at_end=True):
        history = compiled().fit(
            feed.dataset(("x", "y")), epochs=5, callbacks=[feed.callback()], shuffle=False
        )
    assert len(history.history["loss"]) == 1  # the feed ran dry: no empty epochs after it
    figures = settled(feed)
    assert (figures.trained, figures.abandoned, figures.queued) == (12, 0, 0)


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_steps_per_execution_books_every_step_of_each_call_up_to_the_end_of_data():
    sink = RecordingSink()
    feed = Feed(SCHEMA, 4, stage_depth=1, sink=sink)
    with ThreadFiller(feed, separable(count=7), close_at_end=True):
        model = compiled(steps_per_execution=3)  # calls of 3, 3 and a last one with 1 batch
        model.fit(feed.dataset(("x", "y")), epochs=2, callbacks=[feed.callback()], shuffle=False)
    assert sink.trained_seqs == list(range(7))
    assert settled(feed).trained == 7
