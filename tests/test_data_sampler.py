"""The data sources' sampler, transform and ``MapSource`` (producer/data/sampler.py,
transform.py, source.py): each epoch's permutation, disjoint shards, a global order that the
shard count does not change, seekable passes, the tail, and bad records skipped or failed."""

from __future__ import annotations

import numpy as np
import pytest

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.producer.data.arrays import ArrayRecords
from stagefeed.producer.data.records import BadRecord
from stagefeed.producer.data.sampler import Sampler
from stagefeed.producer.data.source import MapSource
from stagefeed.producer.sources import (
    FillingStream,
    WorkerInfo,
    is_passing,
    is_seekable,
    open_stream,
)

IDS = Schema((ArraySpec("id", "int64"),), batch_size=4)


def ids(n: int) -> ArrayRecords:
    return ArrayRecords({"id": np.arange(n, dtype=np.int64)})


def shard_batches(source, schema, count, epoch=0, start=0):
    """{global batch number: its ids} from every shard of ``count``."""
    got = {}
    for index in range(count):
        worker = WorkerInfo(index, count, f"p{index}", 0, start=start, epoch=epoch)
        for s, batch in enumerate(source(schema, worker)):
            got[index + (start + s) * count] = batch["id"].tolist()
    return got


def test_each_epoch_is_a_permutation_drawn_from_seed_and_epoch():
    sampler = Sampler(1000, 10, seed=3)
    first, second = sampler.order(0), sampler.order(1)
    assert sorted(first.tolist()) == list(range(1000)) == sorted(second.tolist())
    assert first.tolist() != second.tolist()
    assert Sampler(1000, 10, seed=3).order(1).tolist() == second.tolist()
    assert Sampler(1000, 10, seed=4).order(1).tolist() != second.tolist()
    assert Sampler(1000, 10, shuffle=False).order(5).tolist() == list(range(1000))


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_are_disjoint_cover_the_epoch_and_do_not_change_the_global_order(count):
    source = MapSource(ids(103), seed=11, short_batch="drop")
    one = shard_batches(source, IDS, 1, epoch=2)
    some = shard_batches(source, IDS, count, epoch=2)
    assert some == one  # global batch b holds the same records whatever the shard count
    trained = [i for batch in some.values() for i in batch]
    assert len(trained) == len(set(trained)) == 100  # 25 full batches, 3 left out
    left_out = set(range(103)) - set(trained)
    order = Sampler(103, 4, seed=11).order(2).tolist()
    assert left_out == set(order[100:])  # the last places of this epoch's order


def test_a_shard_resumes_at_its_start_within_the_pass():
    source = MapSource(ids(40), seed=1)
    whole = shard_batches(source, IDS, 2, epoch=1)
    later = shard_batches(source, IDS, 2, epoch=1, start=3)
    assert later == {b: whole[b] for b in whole if b >= 6}
    assert is_passing(source) and is_seekable(source)


@pytest.mark.parametrize("count", [1, 3, 11])
def test_with_epochs_a_shards_passes_are_one_stream_that_seeks_anywhere_along_it(count):
    passing, stream = MapSource(ids(40), seed=1), MapSource(ids(40), seed=1, epochs=3)
    assert not is_passing(stream) and is_seekable(stream)

    def batches(source, index, epoch=0, start=0):
        worker = WorkerInfo(index, count, "p", 0, start=start, epoch=epoch)
        return [b["id"].tolist() for b in source(IDS, worker)]

    for index in range(count):
        whole = [b for epoch in range(3) for b in batches(passing, index, epoch)]
        assert batches(stream, index) == whole
        for start in range(len(whole) + 1):
            assert batches(stream, index, start=start) == whole[start:]
    with pytest.raises(ConfigError, match="epochs must be a positive integer"):
        MapSource(ids(40), epochs=0)


def test_a_tail_is_refused_at_start_unless_dropped():
    with pytest.raises(ConfigError) as info:
        MapSource(ids(10), name="npy:ids.npy")(IDS, WorkerInfo(0, 1, "p", 0))
    assert str(info.value) == (
        "npy:ids.npy: 10 records are 2 batches of 4 and 2 left over; pass --short-batch drop "
        "to leave the last records of each epoch's order out (other ones each epoch when "
        "shuffled)"
    )
    with pytest.raises(ConfigError, match="3 records make no batch of 4"):
        MapSource(ids(3), short_batch="drop")(IDS, WorkerInfo(0, 1, "p", 0))


def test_a_schema_the_records_cannot_fill_is_refused_at_start():
    schema = Schema((ArraySpec("id", "int64"), ArraySpec("label", "int32")), batch_size=4)
    with pytest.raises(ConfigError, match=r"arrays has no 'label' \(the schema's id, label"):
        MapSource(ids(8))(schema, WorkerInfo(0, 1, "p", 0))
    narrow = Schema((ArraySpec("id", "int32"),), batch_size=4)
    with pytest.raises(ConfigError, match=r"id is int64\[\] a record, the schema says int32"):
        MapSource(ids(8))(narrow, WorkerInfo(0, 1, "p", 0))


def flip(record, rng):
    """A transform: the id and a draw of its own generator."""
    return {"id": record["id"], "draw": np.float32(rng.random())}


DRAWN = Schema((ArraySpec("id", "int64"), ArraySpec("draw", "float32")), batch_size=4)


def test_the_transform_draws_the_same_per_record_whatever_the_shard_count():
    def draws(count, epoch):
        got = {}
        for index in range(count):
            for batch in MapSource(ids(24), seed=5, transform=flip)(
                DRAWN, WorkerInfo(index, count, "p", 0, epoch=epoch)
            ):
                got.update(zip(batch["id"].tolist(), batch["draw"].tolist(), strict=True))
        return got

    assert draws(1, 0) == draws(3, 0)
    assert draws(1, 0) != draws(1, 1)  # another epoch, other draws
    assert len(set(draws(1, 0).values())) == 24


class Flaky(ArrayRecords):
    """Ids where record ``bad`` cannot be read."""

    def __init__(self, n, bad):
        super().__init__({"id": np.arange(n, dtype=np.int64)}, "flaky")
        self.bad = set(bad)

    def record(self, index):
        if index in self.bad:
            raise BadRecord(f"{self.where(index)}: cannot be decoded")
        return super().record(index)

    take = None  # one record at a time, as a decoder reads


def test_a_bad_record_ends_the_source_in_one_line_naming_it_under_fail():
    source = MapSource(Flaky(8, {5}), shuffle=False)
    batches = source(IDS, WorkerInfo(0, 1, "p", 0))
    assert next(batches)["id"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ConfigError) as info:
        next(batches)
    assert str(info.value) == (
        "flaky: bad record: flaky record 5: cannot be decoded (--on-bad-record skip to leave "
        "such records out)"
    )


def test_bad_records_are_skipped_counted_and_their_rows_filled_from_their_batch_under_skip():
    source = MapSource(Flaky(12, {5, 6}), shuffle=False, on_bad_record="skip")
    got = [b["id"].tolist() for b in source(IDS, WorkerInfo(0, 1, "p", 0))]
    assert got == [[0, 1, 2, 3], [4, 4, 7, 7], [8, 9, 10, 11]]
    assert source.bad == 2
    assert source.report() == (
        "2 bad records skipped (--on-bad-record skip), the first: flaky record 5: cannot be "
        "decoded; flaky record 6: cannot be decoded"
    )
    everything_bad = MapSource(Flaky(4, {0, 1, 2, 3}), shuffle=False, on_bad_record="skip")
    with pytest.raises(ConfigError, match="every record of batch 0 of epoch 0 is bad"):
        list(everything_bad(IDS, WorkerInfo(0, 1, "p", 0)))


def test_a_transform_that_raises_or_makes_a_wrong_row_is_a_bad_record():
    def wrong(record, rng):
        if record["id"] == 2:
            raise ValueError("cannot tokenize")
        if record["id"] == 3:
            return {"id": record["id"], "draw": np.zeros(2, np.float32)}
        return {"id": record["id"], "draw": 1.5}  # a Python float: float64, not float32

    source = MapSource(ids(4), shuffle=False, transform=wrong, on_bad_record="skip")
    with pytest.raises(ConfigError, match="every record of batch 0"):
        list(source(DRAWN, WorkerInfo(0, 1, "p", 0)))
    assert source.bad_shown == [
        "arrays record 0: draw is float64, expected float32",
        "arrays record 1: draw is float64, expected float32",
        "arrays record 2: the transform failed: ValueError: cannot tokenize",
    ]


@pytest.mark.parametrize("records", [ids(20), Flaky(20, {6})], ids=["take", "record-by-record"])
def test_a_map_source_writes_each_batch_into_the_buffer_it_is_given(records):
    """A ``MapSource`` call is a filling source: ``open_stream`` makes it a ``FillingStream``,
    whose ``fill_into`` (a shared-memory slot's arrays) writes the batch in place, no batch
    made beside it; the same batches as iterating."""
    source = MapSource(records, seed=4, on_bad_record="skip")
    worker = WorkerInfo(1, 2, "p", 0, epoch=1)
    expected = [b["id"].tolist() for b in source(IDS, worker)]
    stream = open_stream("mine:data", IDS, worker, pool_size=2, factory=source)
    assert isinstance(stream, FillingStream)
    slot = {"id": np.full(4, -1, np.int64)}
    got = []
    while stream.fill_into(slot):
        got.append(slot["id"].tolist())
    assert got == expected and len(got) == 2
