"""The trainer's books of passes (``consumer.intake.passes``) and the pass ends kept in the
input position (``common.position``): plain objects, no processes."""

from __future__ import annotations

import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.position import InputPosition, StreamPosition, epoch_of
from stagefeed.consumer.intake.passes import PassBooks


def test_an_epoch_completes_only_when_every_shard_ended_its_pass():
    books = PassBooks(pass_count=2)
    assert books.join(0, 3) is None and books.shards == 0  # a hello settles no count
    assert books.join(0, 2) is None and books.settle(0, 2) is None  # a batch does
    assert "2 shards" in (books.join(0, 3) or "")  # another shard count: refused
    assert "2 shards" in (books.settle(1, 3) or "")
    assert books.ended(1, 0, 30) is None
    assert not books.complete() and books.missing() == [0]
    assert books.ended(0, 1, 60) is not None  # ahead of the epoch: ignored, said why
    assert books.ended(0, 0, 28) is None and books.complete()
    assert books.advance(enqueued=58) == 1 and not books.complete()
    assert books.start_of(0, 1) == 28 and books.start_of(1, 1) == 30
    assert books.ended(1, 0, 30) is None  # said again after a reconnect: the same end
    assert books.ended(1, 0, 31) is not None  # another end of a booked pass: refused
    assert books.ended_by(57, 0) == [] and books.ended_by(58, 0) == [(0, 58)]


def test_a_resumed_position_gives_the_epoch_whose_passes_are_all_trained():
    position = InputPosition(2)
    position.streams[0] = StreamPosition(35, set(), None, [30, 60])
    position.streams[1] = StreamPosition(30, set(), None, [30])
    assert epoch_of(position) == 1
    position.streams[1] = StreamPosition(29, {30}, None, [30])
    assert epoch_of(position) == 0  # batch 29 of shard 1 (pass 0) is not trained
    books = PassBooks(3, position)
    assert (books.shards, books.epoch, books.ends) == (2, 0, {0: [], 1: []})
    books = PassBooks(3, InputPosition(2, {0: StreamPosition(61, set(), None, [30, 60]),
                                           1: StreamPosition(35, set(), None, [30])}))
    assert (books.epoch, books.ends) == (1, {0: [30], 1: [30]})  # pass 1 is said again


def test_pass_ends_round_trip_in_the_position_and_older_files_read_as_before():
    stream = StreamPosition(61, {63}, None, [30, 60])
    assert StreamPosition.from_dict(stream.to_dict(), "s") == stream
    assert "passes" not in StreamPosition(3).to_dict()
    assert StreamPosition.from_dict({"next": 3, "above": [], "end": None}, "s").passes == []
    with pytest.raises(ConfigError, match="passes must be ascending"):
        StreamPosition.from_dict({"next": 3, "above": [], "end": None, "passes": [5, 4]}, "s")
    assert stream.union(StreamPosition(40, set(), None, [30])).passes == [30, 60]
