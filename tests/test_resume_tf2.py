"""A custom ``tf.function`` loop resumes exactly (docs/resume.md, "A custom loop"): it saves its
weights and ``feed.position()`` as JSON, and a later ``ServedFeed(options, resume=...)`` goes
on from them with the producer restarted; every batch of the stream is trained once overall.
The second feed confirms its saves (``confirm_saves``): its producer, finished, stays until
the loop says its last position is saved.

Real producer processes (``stagefeed produce``, killed with SIGKILL between the two feeds) and
the row counter of ``tests/helpers/resume_models.py`` as the loop's only weight. The first loop
stops
while the queue and tf.data's buffers hold batches (no rate limit): a position that counted
them as trained leaves their rows counted ``EPOCHS - 1`` times.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import stagefeed
from stagefeed import InputPosition, ServedFeed, TrainerOptions
from tests.conftest import free_tcp_port, wait_for
from tests.helpers.procs import log_text
from tests.helpers.resume_models import EPOCHS, ROWS, SCHEMA, stream

pytestmark = pytest.mark.slow

FIRST_STEPS = 10
BATCHES = len(stream(0, 1))  # one shard, every pass
TIMEOUT_S = 120


def _options() -> TrainerOptions:
    return TrainerOptions(bind=f"tcp://127.0.0.1:{free_tcp_port()}", schema=SCHEMA,
                          queue_mb=1, stage_depth=2, producer_timeout_s=4)  # fmt: skip


def _producer(spawn, feed: ServedFeed, name: str):
    args = ["produce", "--connect", feed.endpoint, "--workers", "1", "--schema",
            "tests.helpers.resume_models:SCHEMA", "--source",
                "tests.helpers.resume_models:rows"]  # fmt: skip
    return spawn(args, name)


def _train(feed: ServedFeed, counts: tf.Variable, steps: int | None) -> int:
    """The user's loop: ``steps`` steps (None: until the data ends), each booked."""

    @tf.function
    def step(batch):
        counts.assign_add(tf.reduce_sum(tf.one_hot(batch["ids"], ROWS), axis=0))

    done = 0
    for batch in feed.dataset():
        step(batch)
        feed.books.step_done()
        done += 1
        if done == steps:
            break
    return done


def test_a_custom_loop_saves_its_position_and_a_resumed_feed_trains_every_batch_once(
    spawn, tmp_path
):
    counts = tf.Variable(tf.zeros([ROWS]))
    with ServedFeed(_options(), positions=True) as feed:
        producer = _producer(spawn, feed, "producer")
        assert _train(feed, counts, FIRST_STEPS) == FIRST_STEPS
        # The save must leave batches queued and untrained (what makes the position's
        # exactness matter): wait for them rather than assume the producer is ahead (on a
        # loaded machine the loop kept up with it and the queue was empty).
        assert wait_for(lambda: feed.figures().queued > 0, TIMEOUT_S), feed.figures()
        # The user's checkpoint: the weights first, then the position read after them.
        np.save(tmp_path / "counts.npy", counts.numpy())
        with open(tmp_path / "position.json", "w") as f:
            json.dump(feed.position().to_dict(), f)
        held = feed.figures()
    producer.kill_group()
    assert held.queued > 0, held  # the stop left dequeued and queued batches untrained
    with open(tmp_path / "position.json") as f:
        saved = json.load(f)
    # Exactly the batches of the first loop's steps, not always 0..9: two enqueue threads may
    # queue batch 10 before 9, and then 9 is still queued ({"next": 9, "above": [10]}, once).
    first = saved["streams"]["0"]
    assert first["next"] + len(first["above"]) == FIRST_STEPS, first

    counts = tf.Variable(np.load(tmp_path / "counts.npy"))
    resume = InputPosition.from_dict(saved, "position.json")
    with ServedFeed(_options(), resume=resume, confirm_saves=True) as feed:
        again = _producer(spawn, feed, "producer-again")
        trained = _train(feed, counts, None)
        feed.check()
        final = feed.position()
        assert again.proc.poll() is None  # finished, and waiting for the loop's checkpoint
        feed.saved(final)  # the loop wrote its checkpoint with ``final``
        assert again.wait(TIMEOUT_S) == 0, log_text(again)[-3000:]
    assert f"shard 0 of 1 from batch {first['next']}" in log_text(again)  # the welcome's start
    assert f"the trainer saved all {BATCHES} batches" in log_text(again)
    assert trained == BATCHES - FIRST_STEPS
    assert np.array_equal(counts.numpy(), np.full(ROWS, EPOCHS, np.float32)), counts.numpy()
    assert final.streams[0].next == BATCHES and final.streams[0].end == BATCHES


def test_position_needs_a_feed_that_books_positions():
    refused = pytest.raises(stagefeed.ConfigError, match="positions=True")
    with ServedFeed(_options()) as feed, refused:
        feed.position()
    with pytest.raises(stagefeed.ConfigError, match="not an input position"):
        ServedFeed(_options(), resume={"version": 0})
