"""Ledger: books per connection; every batch is trained, queued at stop, or dropped."""

from __future__ import annotations

import threading

from stagefeed.common.errors import DropReason
from stagefeed.consumer.books.ledger import (
    MAX_SEQ_AHEAD,
    UNIDENTIFIED,
    Ledger,
    ProducerTotals,
    Totals,
)


def test_accept_enqueue_train_accounting():
    ledger = Ledger()
    a, b = ledger.open("a"), ledger.open("b")
    assert (a, b) == (0, 1)
    assert ledger.accept(a, 0, 100) is None
    assert ledger.accept(b, 0, 100) is None
    assert ledger.accept(a, 1, 100) is None
    for index in (a, b, a):
        ledger.enqueued(index)
    ledger.trained([a, b], [0, 0])
    summary = ledger.summary()
    assert summary["a"]["received"] == 2 and summary["a"]["trained"] == 1
    assert summary["a"]["queued_at_stop"] == 1
    assert summary["b"]["queued_at_stop"] == 0
    assert ledger.totals().received_bytes == 300


FIGURES = ("received", "trained", "queued_at_stop", "abandoned", "not_enqueued")


def test_the_rows_add_up_to_the_totals_and_each_batch_is_in_one_figure():
    """Trained, abandoned (a Keras iterator dropped them), queued, still in the intake, or
    dropped: per connection and in total, by one definition (``ProducerStats``)."""
    ledger = Ledger()
    a, b = ledger.open("a"), ledger.open("b")
    for seq in range(6):
        assert ledger.accept(a, seq, 10) is None
    for seq in range(4):
        assert ledger.accept(b, seq, 10) is None
    for index in [a] * 5 + [b] * 3:  # a's sixth and b's fourth still in the intake
        ledger.enqueued(index)
    ledger.trained([a, a, b], [0, 1, 0])
    ledger.abandoned([a, b], [2, 1])
    ledger.drop(DropReason.DUPLICATE, "again", a)
    rows = ledger.summary()
    totals = ledger.totals()
    assert (rows["a"]["trained"], rows["a"]["abandoned"], rows["a"]["queued_at_stop"],
            rows["a"]["not_enqueued"]) == (2, 1, 2, 1)  # fmt: skip
    assert (totals.trained, totals.abandoned, totals.queued, totals.not_enqueued) == (3, 2, 3, 2)
    summed = (totals.received, totals.trained, totals.queued, totals.abandoned,
              totals.not_enqueued)  # fmt: skip
    for figure, total in zip(FIGURES, summed, strict=True):
        assert sum(row[figure] for row in rows.values()) == total, figure
    for row in rows.values():
        held = row["trained"] + row["abandoned"] + row["queued_at_stop"] + row["not_enqueued"]
        assert held == row["received"]
    assert totals.dropped == 1


def test_duplicate_is_dropped_under_its_connection():
    ledger = Ledger()
    a = ledger.open("a")
    ledger.accept(a, 5, 1)
    assert ledger.accept(a, 5, 1) == DropReason.DUPLICATE
    assert ledger.summary()["a"]["dropped"] == {"duplicate": 1}
    assert ledger.drops_by_reason() == {"duplicate": 1}


def test_a_sequence_number_far_ahead_is_refused_and_does_not_move_the_window():
    ledger = Ledger()
    a = ledger.open("a")
    assert ledger.accept(a, 0, 1) is None
    assert ledger.accept(a, 2**63 - 1, 1) == DropReason.SEQ_RANGE
    assert ledger.accept(a, MAX_SEQ_AHEAD + 1, 1) == DropReason.SEQ_RANGE
    assert ledger.accept(a, 1, 1) is None  # the window did not move
    summary = ledger.summary()["a"]
    assert summary["seq_last"] == 1 and summary["seq_missing"] == 0
    assert summary["dropped"] == {"seq_range": 2}


def test_two_connections_with_one_name_keep_separate_books():
    ledger = Ledger()
    first, second = ledger.open("p"), ledger.open("p")
    ledger.accept(first, 0, 1)
    assert ledger.accept(second, 0, 1) is None  # not a duplicate: another connection
    summary = ledger.summary()
    assert set(summary) == {"p", f"p#{second}"}  # the first keeps its key: nothing renamed


def test_a_name_claimed_again_renames_nothing_and_links_nothing():
    """An impostor saying hello with a producer's name and a forged seq: the genuine entry
    keeps its key (its metrics series), and nothing of the impostor lands in its books or in
    the totals' ``seq_missing`` (names link nothing; only the secret session token does)."""
    ledger = Ledger()
    genuine = ledger.open("host-1-0-ab12", session="a" * 32)
    for seq in range(3):
        ledger.accept(genuine, seq, 1)
    before = ledger.read().producers
    impostor = ledger.open("host-1-0-ab12")
    ledger.accept(impostor, 2**63 - 1, 1)
    books = ledger.read()
    assert books.producers["host-1-0-ab12"] == before["host-1-0-ab12"]
    assert books.producers[f"host-1-0-ab12#{impostor}"].seq_missing == 0
    assert books.totals.seq_missing == 0
    forger = ledger.open("host-1-0-ab12", session="b" * 32)  # a guessed token links nothing
    ledger.accept(forger, 2**62, 1)
    assert ledger.totals().seq_missing == 0
    assert not ledger.delivered(ledger.open("x", session="c" * 32))
    assert ledger.delivered(ledger.open("y", session="a" * 32))  # the same run, reconnected


def test_keys_are_unique_even_when_a_name_looks_like_a_key():
    ledger = Ledger()
    indices = [ledger.open(name) for name in ("p", "p#1", "p", "p#2")]
    keys = [key for key in ledger.summary()]
    assert len(set(keys)) == len(indices) == 4, keys


def test_drops_without_a_connection_do_not_grow_the_ledger():
    ledger = Ledger()
    for _ in range(1000):
        ledger.drop(DropReason.NO_HELLO, "bad")
    summary = ledger.summary()
    assert list(summary) == [UNIDENTIFIED]
    assert summary[UNIDENTIFIED]["dropped"] == {"no_hello": 1000}


def test_idle_connections_are_forgotten_and_the_books_are_bounded():
    ledger = Ledger(max_entries=3)
    indices = [ledger.open(f"p{i}") for i in range(3)]
    assert ledger.open("p3") is None  # full
    ledger.accept(indices[0], 0, 1)
    assert not ledger.forget_if_idle(indices[0])  # it delivered: kept
    assert ledger.forget_if_idle(indices[1])
    assert ledger.open("p4") is not None
    assert ledger.drops_by_reason() == {"peer_limit": 1}


def test_refused_hellos_are_counted_by_declared_name_within_a_bound():
    ledger = Ledger()
    for i in range(300):
        ledger.refused(f"p{i}", "spec_mismatch", "images: ...")
    refusals = ledger.refusals()
    assert len(refusals) <= 257 and refusals["p0"] == {"spec_mismatch": 1}
    assert sum(c["spec_mismatch"] for c in refusals.values()) == 300


def test_concurrent_accepts_are_all_booked():
    ledger = Ledger()
    indices = [ledger.open(f"p{t}") for t in range(4)]

    def work(index: int) -> None:
        for seq in range(500):
            ledger.accept(index, seq, 10)

    threads = [threading.Thread(target=work, args=(i,)) for i in indices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.totals().received == 2000


def test_a_producer_carrying_on_after_a_cut_connection_shows_the_hole_as_missing():
    ledger = Ledger()
    first = ledger.open("p", session="5e" * 16)
    for seq in range(4):
        ledger.accept(first, seq, 1)
    second = ledger.open("p", session="5e" * 16)  # reconnected; seq 4 was lost on the wire
    for seq in range(5, 8):
        ledger.accept(second, seq, 1)
    assert ledger.totals().seq_missing == 1
    summary = ledger.summary()
    assert summary["p"]["seq_missing"] == 0 and summary[f"p#{second}"]["seq_missing"] == 1


def test_abandoned_batches_are_not_counted_as_queued():
    ledger = Ledger()
    a = ledger.open("a")
    for seq in range(3):
        ledger.accept(a, seq, 1)
        ledger.enqueued(a)
    ledger.trained([a], [0])
    ledger.abandoned([a], [1])
    summary = ledger.summary()["a"]
    assert (summary["trained"], summary["abandoned"], summary["queued_at_stop"]) == (1, 1, 1)


def test_a_sequence_number_before_the_connections_first_is_refused():
    ledger = Ledger()
    a = ledger.open("a")
    assert ledger.accept(a, 2**63 - 1, 1) is None  # a connection's first number opens it
    assert ledger.accept(a, 0, 1) == DropReason.SEQ_RANGE
    assert ledger.summary()["a"]["seq_missing"] == 0


def test_refused_hellos_are_logged_at_most_once_per_interval(caplog):
    ledger = Ledger()
    with caplog.at_level("WARNING", logger="stagefeed.consumer.books.ledger"):
        for i in range(50):
            ledger.refused(f"p{i}", "spec_mismatch", "images: ...")
    assert len([r for r in caplog.records if "refused producer" in r.message]) == 1
    assert ledger.refusals_by_reason() == {"spec_mismatch": 50}


def test_read_gives_every_counter_typed_and_keyed_like_the_summary():
    ledger = Ledger()
    run = "0f" * 16
    first, second, other = ledger.open("p", run), ledger.open("p", run), ledger.open("q")
    for seq in (0, 1, 3):  # seq 2 never came
        ledger.accept(first, seq, 10)
    ledger.accept(second, 5, 10)  # the same producer reconnected: seq 4 lost between them
    ledger.accept(other, 0, 10)
    ledger.accept(other, 0, 10)  # duplicate
    for index in (first, other):
        ledger.enqueued(index)
    ledger.trained([first], [0])
    ledger.drop(DropReason.HEADER_NOT_MSGPACK, "junk")
    ledger.peer_event("accepted")
    ledger.refused("r", "spec_mismatch", "images: ...")
    books = ledger.read()
    assert books.totals == Totals(
        received=5, received_bytes=50, enqueued=2, trained=1, dropped=2, seq_missing=2,
        queued=1, not_enqueued=3,
    )
    assert books.totals == ledger.totals()
    assert books.producers == {
        "p": ProducerTotals(received=3, trained=1, seq_missing=1),
        f"p#{second}": ProducerTotals(received=1, trained=0, seq_missing=1),
        "q": ProducerTotals(received=1, trained=0, seq_missing=0),
    }
    assert set(ledger.summary()) == set(books.producers) | {UNIDENTIFIED}
    assert books.dropped == ledger.drops_by_reason() == {"duplicate": 1, "header_not_msgpack": 1}
    assert books.peer_events == {"accepted": 1}
    assert books.refused == {"spec_mismatch": 1}
