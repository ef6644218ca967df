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


def test_model_fit_on_batches_from_a_producer_process(start_cli):
    port = free_tcp_port()
    options = TrainerOptions(
        bind=f"tcp://127.0.0.1:{port}", schema=keras_images.SCHEMA, queue_mb=4, stage_depth=2
    )
    with ServedFeed(options) as feed:
        # No batch flags: the producer adopts the schema from the trainer's welcome.
        producer = start_cli(
            ["produce", "--connect", feed.endpoint, "--source", "examples.keras_images:batches",
             "--max-batches", "40"],
            name="producer",
        )  # fmt: skip
        model = keras_images.build_model(feed)
        history = model.fit(
            feed.dataset(("images", "labels"), cast="step"),
            steps_per_epoch=10,
            epochs=3,
            callbacks=[feed.callback()],
            shuffle=False,
            verbose=0,
        ).history
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
    port = free_tcp_port()
    options = TrainerOptions(
        bind=f"tcp://127.0.0.1:{port}", schema=keras_images.SCHEMA, queue_mb=4, stage_depth=2
    )
    with ServedFeed(options) as feed:
        fired = threading.Event()
        watchdog = threading.Timer(120.0, lambda: (fired.set(), feed.close()))
        watchdog.start()
        producer = start_cli(
            ["produce", "--connect", feed.endpoint, "--source", "examples.keras_images:batches",
             "--max-batches", "15"],
            name="producer",
        )  # fmt: skip
        model = keras_images.build_model(feed)
        try:
            history = model.fit(
                feed.dataset(("images", "labels"), cast="step"),
                steps_per_epoch=10,
                epochs=2,
                callbacks=[feed.callback()],
                shuffle=False,
                verbose=0,
            ).history
        finally:
            watchdog.cancel()
        assert not fired.is_set(), "fit hung until the watchdog closed the feed"
        feed.check()
        assert producer.wait(60) == 0, producer.output()
        assert feed.run_end.verdict.data_ended
    assert history["stagefeed_trained"] == [10, 15]
    (books,) = feed.ledger.summary().values()
    assert books["received"] == 15 and books["trained"] == 15 and books["queued_at_stop"] == 0
