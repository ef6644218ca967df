"""The TF 2 path end to end: real producer processes -> the intake -> ``ServedFeed`` ->
``model.fit`` (Keras 3), with the books of every batch."""

from __future__ import annotations

import numpy as np
import pytest

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
    (books,) = feed.ledger.summary().values()
    assert books["received"] == 40 and books["trained"] == 30 and books["dropped"] == {}
    assert books["trained"] + books["abandoned"] + books["queued_at_stop"] + books[
        "not_enqueued"
    ] == books["received"]
