"""SequenceTracker: duplicates, gaps and reordering with bounded memory."""

from __future__ import annotations

import random

from stagefeed.consumer.books.sequence import WINDOW, SequenceTracker


def test_in_order_stream_has_no_gaps_or_duplicates():
    t = SequenceTracker()
    assert all(t.record(s) for s in range(1000))
    assert (t.unique, t.duplicates, t.missing) == (1000, 0, 0)


def test_reordered_stream_is_not_mistaken_for_duplicates():
    seqs = list(range(500))
    rng = random.Random(1)
    for i in range(0, 500, 4):  # local reordering, as several enqueue threads produce
        chunk = seqs[i : i + 4]
        rng.shuffle(chunk)
        seqs[i : i + 4] = chunk
    t = SequenceTracker()
    assert all(t.record(s) for s in seqs)
    assert (t.unique, t.duplicates, t.missing) == (500, 0, 0)


def test_duplicates_are_refused_and_counted():
    t = SequenceTracker()
    for s in (0, 1, 2, 1, 2, 3):
        t.record(s)
    assert (t.unique, t.duplicates, t.missing) == (4, 2, 0)


def test_gap_counts_as_missing():
    t = SequenceTracker()
    for s in [*range(10), *range(15, 20)]:
        t.record(s)
    assert t.missing == 5


def test_stream_joined_midway_counts_from_first_seen():
    t = SequenceTracker()
    for s in range(5000, 5010):
        t.record(s)
    assert (t.lowest, t.highest, t.missing) == (5000, 5009, 0)


def test_memory_is_bounded_and_old_replays_are_refused():
    t = SequenceTracker()
    for s in range(10 * WINDOW):
        t.record(s)
    assert len(t.recent) <= WINDOW
    assert t.record(3) is False  # far older than the window: a replay
    assert t.duplicates == 1
