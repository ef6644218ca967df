"""Ledger: every message received is trained, queued at stop, or dropped with a reason."""

from __future__ import annotations

import threading

from stagefeed.common.errors import DropReason
from stagefeed.common.ledger import UNIDENTIFIED, Ledger


def test_accept_enqueue_train_accounting():
    ledger = Ledger()
    a = ledger.accept("a", 0, 100)
    b = ledger.accept("b", 0, 100)
    assert (a, b) == (0, 1)
    assert ledger.accept("a", 1, 100) == 0
    for index in (0, 1, 0):
        ledger.enqueued(index)
    ledger.trained([0, 1], [0, 0])
    summary = ledger.summary()
    assert summary["a"]["received"] == 2 and summary["a"]["trained"] == 1
    assert summary["a"]["queued_at_stop"] == 1
    assert summary["b"]["queued_at_stop"] == 0
    assert ledger.totals()["received_bytes"] == 300


def test_duplicate_is_dropped_under_its_producer():
    ledger = Ledger()
    ledger.accept("a", 5, 1)
    assert ledger.accept("a", 5, 1) is None
    assert ledger.summary()["a"]["dropped"] == {"duplicate": 1}
    assert ledger.drops_by_reason() == {"duplicate": 1}


def test_drops_from_unknown_producers_do_not_grow_the_ledger():
    ledger = Ledger()
    for i in range(1000):
        ledger.drop(DropReason.LABEL_RANGE, "bad", producer=f"hostile-{i}")
    summary = ledger.summary()
    assert list(summary) == [UNIDENTIFIED]
    assert summary[UNIDENTIFIED]["dropped"] == {"label_range": 1000}


def test_producer_limit_drops_new_ids():
    ledger = Ledger(max_producers=2)
    assert ledger.accept("a", 0, 1) == 0
    assert ledger.accept("b", 0, 1) == 1
    assert ledger.accept("c", 0, 1) is None
    assert ledger.drops_by_reason() == {"producer_limit": 1}
    assert ledger.producer_count() == 2


def test_trained_duplicates_are_detected():
    ledger = Ledger()
    ledger.accept("a", 0, 1)
    ledger.trained([0, 0], [0, 0])
    assert ledger.summary()["a"]["trained_duplicates"] == 1


def test_concurrent_accepts_are_all_counted():
    """Four threads, each one message behind or ahead of the others, as receive threads are."""
    ledger = Ledger()
    barrier = threading.Barrier(4)

    def worker(offset):
        for seq in range(offset, 4000, 4):
            barrier.wait()
            ledger.accept("a", seq, 1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.summary()["a"]["received"] == 4000
    assert ledger.summary()["a"]["seq_missing"] == 0
