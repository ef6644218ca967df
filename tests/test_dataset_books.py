"""Per-step books of the TF 2 feed in a custom tf.function loop: identity, abandonment, stall."""

from __future__ import annotations

import gc
import itertools
import time

import numpy as np
import tensorflow as tf

from examples.filler import ThreadFiller
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.tf2 import pipeline
from stagefeed.consumer.tf2.eager_queue import EagerQueueFeed
from stagefeed.consumer.tf2.feed import Feed
from stagefeed.consumer.tf2.step_books import DequeueLog, StepBooks
from tests.conftest import wait_for

# ``marker`` carries the batch's seq, so a step can tell which batch it trained.
SCHEMA = Schema((ArraySpec("marker", "int64", ()), ArraySpec("x", "float32", (3,))), 2)


class RecordingSink:
    """Has the lead's ``Ledger.trained(indices, seqs)`` signature and the optional ``abandoned``."""

    def __init__(self) -> None:
        self.trained_seqs: list[int] = []
        self.abandoned_seqs: list[int] = []
        self.peers: set[int] = set()

    def trained(self, peers: list[int], seqs: list[int]) -> None:
        self.peers.update(peers)
        self.trained_seqs.extend(seqs)

    def abandoned(self, peers: list[int], seqs: list[int]) -> None:
        self.abandoned_seqs.extend(seqs)


def batches(delay_s: float = 0.0, count: int | None = None):
    for seq in itertools.count() if count is None else range(count):
        if delay_s:
            time.sleep(delay_s)
        yield {"marker": np.full(2, seq, np.int64), "x": np.full((2, 3), seq, np.float32)}


@tf.function
def step(iterator):
    """A stand-in train step: consumes one batch, returns the seq it carried."""
    element = next(iterator)
    return element["marker"][0]


def test_each_step_books_exactly_the_batch_it_trained_and_the_books_balance():
    sink = RecordingSink()
    feed = Feed(SCHEMA, 4, stage_depth=2, sink=sink)
    with ThreadFiller(feed, batches(), peer=7):
        iterator = iter(feed.dataset())
        for _ in range(6):
            seen = int(step(iterator))
            _, seqs = feed.books.step_done()
            assert seqs == [seen]
        assert wait_for(lambda: feed.figures().in_flight >= 1, timeout=10), (
            "no batch buffered ahead within 10 s"
        )
        feed.books.end()  # the buffered batches are abandoned with the iterator
        del iterator
        gc.collect()
    figures = feed.figures()
    assert sink.trained_seqs == list(range(6)) and sink.peers == {7}
    assert figures.trained == 6 and figures.abandoned == len(sink.abandoned_seqs) > 0
    assert figures.enqueued == figures.trained + figures.abandoned + figures.queued
    assert (figures.unaccounted, figures.unbooked, figures.in_flight) == (0, 0, 0)


def test_a_dropped_iterator_abandons_its_buffered_batches_and_the_next_one_is_booked():
    sink = RecordingSink()
    feed = Feed(SCHEMA, 16, stage_depth=2, sink=sink)
    filler = ThreadFiller(feed, batches(count=16)).start()
    dataset = feed.dataset()
    first = iter(dataset)
    assert [int(step(first)) for _ in range(2)] == [0, 1]
    feed.books.step_done(2)
    assert wait_for(lambda: feed.figures().in_flight >= 2, timeout=10), (
        f"{feed.figures().in_flight} of 2 batches buffered ahead within 10 s"
    )
    del first  # its prefetched batches are gone with it
    gc.collect()
    second = iter(dataset)
    seen = [int(step(second)) for _ in range(3)]
    feed.books.step_done(3)
    assert sink.trained_seqs == [0, 1, *seen]
    assert seen[0] >= 4 and sink.abandoned_seqs == list(range(2, seen[0]))
    filler.join()
    assert len(list(second)) == 16 - seen[-1] - 1  # the rest, up to the closed queue's end
    feed.books.step_done(16 - seen[-1] - 1)
    figures = feed.figures()
    assert figures.trained + figures.abandoned == figures.enqueued == 16
    assert figures.queued == figures.unaccounted == 0


def run_timed(feed: Feed, steps: int) -> float:
    iterator = iter(feed.dataset())
    step(iterator)  # trace outside the timed run
    feed.books.step_done()
    feed.books.begin()
    for _ in range(steps):
        step(iterator)
        feed.books.step_done()
    feed.books.end()
    return feed.figures().input_wait


def test_input_wait_is_the_share_of_time_dequeues_blocked_on_an_empty_queue():
    # At most ~3 batches wait in the queue and buffers: most of the 8 steps wait for one.
    slow = Feed(SCHEMA, 1, stage_depth=1)
    with ThreadFiller(slow, batches(delay_s=0.1)):
        slow_wait = run_timed(slow, 8)
        slow_figures = slow.figures()
    fast = Feed(SCHEMA, 8, stage_depth=1)
    with ThreadFiller(fast, batches()):
        # The queue is full before training starts.
        assert wait_for(lambda: fast.figures().in_queue == 8, timeout=30), (
            f"the queue holds {fast.figures().in_queue} of 8 after 30 s"
        )
        run_timed(fast, 5)
    assert slow_figures.wait_s >= 0.35 and slow_wait > 0.5
    # A ready batch: no wait to speak of, next to the slow source's in the same run.
    assert fast.figures().wait_s < slow_figures.wait_s / 4, (fast.figures(), slow_figures)


def test_a_full_log_loses_identities_not_counts():
    queue = EagerQueueFeed(SCHEMA, 8)
    books = StepBooks(queue, DequeueLog(capacity=3), sink=RecordingSink())
    dataset, _ = pipeline.build(queue, books.dequeues, stage_depth=1)
    for arrays in batches(count=6):
        queue.enqueue(arrays, 0, int(arrays["marker"][0]))
    queue.close()
    assert len(list(dataset)) == 6  # six steps without booking: the log holds three
    _, seqs = books.step_done(6)
    figures = books.figures()
    assert seqs == [0, 1, 2] and (figures.trained, figures.unbooked) == (6, 3)
    assert figures.unaccounted == 0
