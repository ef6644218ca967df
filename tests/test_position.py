"""The input position (``common/position.py``) and the trainer's per-shard books
(``consumer/books/shard_books.py``, through the ``Ledger``): what was trained, not a guess; batches
trained or in flight refused; the union of two workers' books; the welcome's position."""

from __future__ import annotations

import pytest

from stagefeed.common import protocol
from stagefeed.common.errors import ConfigError, DropReason, ProtocolError
from stagefeed.common.position import InputPosition, StreamPosition, skip_of
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.books.shard_books import ShardBooks


def test_a_low_water_mark_plus_the_few_above_it_holds_out_of_order_training():
    p = StreamPosition()
    for seq in (0, 2, 3, 1, 6):
        p.add(seq)
    assert (p.next, p.above) == (4, {6})
    assert 3 in p and 6 in p and 4 not in p and 5 not in p
    assert p.ranges() == [[6, 6]]
    assert StreamPosition.from_dict(p.to_dict(), "t") == p


def test_the_union_of_two_workers_books_is_a_shard_by_shard_merge():
    a = InputPosition(2, {0: StreamPosition(5, {7}), 1: StreamPosition(2)})
    b = InputPosition(2, {0: StreamPosition(3, {5, 6}), 1: StreamPosition(0, {2, 4})})
    merged = a.merge(b)
    assert merged.streams[0] == StreamPosition(8)
    assert merged.streams[1] == StreamPosition(3, {4})
    with pytest.raises(ConfigError, match="positions of 2 and 3 shards"):
        a.merge(InputPosition(3))


@pytest.mark.parametrize(
    "bad",
    [
        {"version": 2, "shards": 1, "approximate": [], "streams": {}},
        {"version": 1, "shards": 0, "approximate": [], "streams": {}},
        {"version": 1, "shards": 1, "approximate": [],
         "streams": {"1": {"next": 0, "above": [], "end": None}}},
        {"version": 1, "shards": 1, "approximate": [],
         "streams": {"0": {"next": 3, "above": [2], "end": None}}},
        {"version": 1, "shards": 1, "approximate": [],
         "streams": {"0": {"next": 3, "above": [], "end": -1}}},
    ],
)
def test_a_malformed_position_is_a_config_error_naming_where(bad):
    with pytest.raises(ConfigError, match="checkpoint x"):
        InputPosition.from_dict(bad, "checkpoint x")


def test_the_ledger_books_trained_batches_and_refuses_them_again():
    ledger = Ledger(shards=ShardBooks(InputPosition(2, {0: StreamPosition(3)})))
    assert ledger.shards.join(0, 2) is None
    first = ledger.open("p", shard=0)
    assert ledger.accept(first, 2, 10) is DropReason.ALREADY_TRAINED  # in the checkpoint
    assert ledger.accept(first, 3, 10) is None and ledger.accept(first, 4, 10) is None
    second = ledger.open("q", shard=0)  # the same shard on another connection
    assert ledger.accept(second, 4, 10) is DropReason.DUPLICATE  # in flight
    ledger.trained([first], [4])  # out of order: 3 is still queued
    assert ledger.shards.position().streams[0] == StreamPosition(3, {4})
    assert ledger.shards.welcome(0) == (5, [])  # 3 in flight, 4 trained: both skipped
    ledger.abandoned([first], [3])  # taken off the queue untrained: it may come again
    assert ledger.shards.welcome(0) == (3, [[4, 4]])
    assert ledger.accept(second, 5, 10) is None


def test_the_data_ends_only_once_every_shards_stream_is_all_trained_or_in_flight():
    books = ShardBooks(InputPosition(2, {0: StreamPosition(4, end=4)}))
    assert books.missing() == {1: 0}  # shard 1 never said where its stream ends
    assert books.admit(1, 0) is None and books.admit(1, 2) is None
    assert "reach 3" in books.ended(1, 2, 2**62)  # only its reach can be its end
    assert "count is 2, not 3" in books.ended(1, 3, 3)
    assert books.ended(1, 2, 3) is None
    assert books.missing() == {1: 1}  # batch 1 was lost with a killed trainer: not here yet
    assert books.admit(1, 1) is None
    assert books.missing() == {}


def test_a_cluster_worker_waits_only_for_the_shards_that_joined_it():
    """``joined_only`` (a cluster worker: each shard feeds one worker): shard 0 of the union
    is another worker's, so this worker's data ends once its own shard 1 is complete."""
    union = InputPosition(2, {0: StreamPosition(2), 1: StreamPosition(2)})
    books = ShardBooks(union, joined_only=True)
    assert books.missing() == {}  # no shard of its own yet: the intake's rule waits anyway
    assert books.join(1, 2) is None and books.joined == set()  # a hello books nothing
    assert books.settle(1, 2, True) is None and books.joined == {1}  # its first batch does
    assert books.missing() == {1: 2}
    assert books.admit(1, 2) is None and books.ended(1, 2, 3) is None
    assert books.missing() == {}
    assert ShardBooks(union).missing() == {0: 2, 1: 2}  # one trainer waits for every shard


def test_a_hello_with_another_shard_count_is_refused_naming_both():
    books = ShardBooks(InputPosition(2))
    assert "shard 0 of 3; the checkpoint resumed has 2 shards" in books.join(0, 3)
    fresh = ShardBooks()
    # A hello settles nothing (a peer that says hello and leaves fixes no count): the first
    # batch does, and its source's seeking with it.
    assert fresh.join(0, 4096) is None and fresh.join(1, 4) is None and fresh.shards == 0
    assert fresh.position().approximate == set()
    assert fresh.settle(1, 4, False) is None and fresh.shards == 4
    assert fresh.position().approximate == {1}  # its source cannot seek: announced
    assert "the batches trained so far has 4 shards" in fresh.join(0, 2)
    assert "has 4 shards" in fresh.settle(0, 2, True)


def test_the_welcome_carries_the_position_and_a_bad_one_is_refused():
    header = protocol.decode_header(
        protocol.encode_control("welcome", schema={}, max_message=1, credit=0, start=5,
                                skip=[[7, 8], [10, 10]]),  # fmt: skip
        protocol.FROM_TRAINER,
    )
    start, skip = protocol.resume_of_welcome(header)
    assert (start, list(skip_of(skip))) == (5, [7, 8, 10])
    for bad in ([[4, 6]], [[7, 6]], [[7, 8], [8, 9]], [["a", 1]]):
        with pytest.raises(ProtocolError, match="welcome.skip"):
            protocol.resume_of_welcome({"start": 5, "skip": bad})
    hello = protocol.decode_header(
        protocol.encode_control("hello", name="p", schema=None, shard=1, shards=2, seek=True),
        protocol.FROM_PRODUCER,
    )
    assert protocol.shard_of_hello(hello) == (1, 2, True)
