"""The TF 2 path end to end: real producer processes -> the intake -> ``ServedFeed`` ->
``model.fit`` (Keras 3), with the books of every batch."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import stagefeed
from examples import keras_images
from stagefeed import ServedFeed, TrainerOptions
from tests.conftest import free_tcp_port

pytestmark = pytest.mark.slow


def served_feed() -> ServedFeed:
    port = free_tcp_port()
    return ServedFeed(TrainerOptions(
        bind=f"tcp://127.0.0.1:{port}", schema=keras_images.SCHEMA, queue_mb=4, stage_depth=2
    ))  # fmt: skip


def produce(start_cli, feed: ServedFeed, batches: int):
    """A producer process of ``batches`` batches; no batch flags: it adopts the schema from
    the trainer's welcome."""
    return start_cli(
        ["produce", "--connect", feed.endpoint, "--source", "examples.keras_images:batches",
         "--max-batches", str(batches)],
        name="producer",
    )  # fmt: skip


def fit(feed: ServedFeed, epochs: int) -> dict:
    """``fit`` for ``epochs`` of 10 steps on the feed; its history."""
    model = keras_images.build_model(feed)
    return model.fit(
        feed.dataset(("images", "labels"), cast="step"),
        steps_per_epoch=10,
        epochs=epochs,
        callbacks=[feed.callback()],
        shuffle=False,
        verbose=0,
    ).history


def test_model_fit_on_batches_from_a_producer_process(start_cli):
    with served_feed() as feed:
        producer = produce(start_cli, feed, 40)
        history = fit(feed, epochs=3)
        feed.check()
        assert producer.wait(60) == 0, producer.output()
    losses = history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert history["stagefeed_trained"] == [10, 20, 30]
    last = feed.last_step  # the public read of a step's batches (issue 20 item 8)
    assert isinstance(last, stagefeed.TrainedStep) and last.step == 30 and len(last.seqs) == 1
    (name,) = feed.ledger.summary()
    assert feed.producer_name(last.peers[0]) == name and 0 <= last.seqs[0] < 40
    (books,) = feed.ledger.summary().values()
    assert books["received"] == 40 and books["trained"] == 30 and books["dropped"] == {}
    assert books["trained"] + books["abandoned"] + books["queued_at_stop"] + books[
        "not_enqueued"
    ] == books["received"]


def test_the_dataset_ends_when_every_producer_has_ended_so_fit_needs_no_user_thread(start_cli):
    """Issue 20 item 2: one pass of 15 batches, epochs=2 of 10 steps. Epoch 2 trains the 5
    left and ``fit`` returns: the dataset ends once the producer said ``end`` and the queue is
    drained. Before, ``Epoch 2/2`` waited forever. A watchdog closes the feed after 120 s so
    that a regression fails here instead of hanging the suite."""
    with served_feed() as feed:
        fired = threading.Event()
        watchdog = threading.Timer(120.0, lambda: (fired.set(), feed.close()))
        watchdog.start()
        producer = produce(start_cli, feed, 15)
        try:
            history = fit(feed, epochs=2)
        finally:
            watchdog.cancel()
        assert not fired.is_set(), "fit hung until the watchdog closed the feed"
        feed.check()
        assert producer.wait(60) == 0, producer.output()
        assert feed.run_end.verdict.data_ended
    assert history["stagefeed_trained"] == [10, 15]
    (books,) = feed.ledger.summary().values()
    assert books["received"] == 15 and books["trained"] == 15 and books["queued_at_stop"] == 0
