"""Elastic resume: consumer/books/redeal.py (a position of k shards dealt out to k'),
common/data_order.py (the data's order in the hello and the position), and the intake's rules
for both (consumer/books/shard_books.py ``redeal``, consumer/intake/claims.py) over a real
intake with raw DEALER peers. The kill -9 runs at 2, 3 and 1 producers are in
tests/test_data_resume.py."""

from __future__ import annotations

import random

import msgpack
import pytest

from stagefeed.common import protocol
from stagefeed.common.data_order import DataOrder, hello_fields
from stagefeed.common.errors import ConfigError, ProtocolError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition, StreamPosition, epoch_of
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.books.redeal import check_even, redeal
from stagefeed.consumer.books.shard_books import ShardBooks
from stagefeed.consumer.intake.intake import Intake
from tests import test_shard_claims
from tests.test_intake import SCHEMA, Recorder
from tests.test_shard_claims import _hello, _send

peers = test_shard_claims.peers  # the fixture: raw DEALER peers, closed at teardown

ORDER = DataOrder("npy:ids.npy", 96, 4, 5, True)  # 24 global batches an epoch


def trained_records(position: InputPosition) -> set[tuple[int, int]]:
    """``(epoch, global batch)`` of every batch the position names trained, read through the
    order's deal: what a redeal must keep."""
    out = set()
    for shard, stream in position.streams.items():
        per_epoch = ORDER.shard_batches(shard, position.shards)
        for seq in [*range(stream.next), *sorted(stream.above)]:
            out.add((seq // per_epoch, shard + (seq % per_epoch) * position.shards))
    return out


def random_position(rng: random.Random, shards: int) -> InputPosition:
    """Some full epochs, then each shard part way into the next, a few batches above."""
    done = rng.randint(0, 2)
    position = InputPosition(shards, order=ORDER)
    for shard in range(shards):
        per_epoch = ORDER.shard_batches(shard, shards)
        stream = StreamPosition(done * per_epoch + rng.randint(0, per_epoch - 1),
                                passes=[per_epoch * (e + 1) for e in range(done)])  # fmt: skip
        for _ in range(rng.randint(0, 3)):
            stream.add(stream.next + rng.randint(1, per_epoch))
        position.streams[shard] = stream
    return position


@pytest.mark.parametrize("old,new", [(2, 3), (3, 1), (1, 4), (4, 2), (5, 5), (24, 7), (2, 30)])
def test_a_redeal_keeps_every_trained_batch_and_the_ended_epochs(old, new):
    rng = random.Random(old * 100 + new)
    for _ in range(30):
        position = random_position(rng, old)
        dealt = redeal(position, new)
        assert dealt.shards == new and dealt.order == ORDER
        assert trained_records(dealt) == trained_records(position)
        assert epoch_of(dealt) == epoch_of(position)
        assert trained_records(redeal(dealt, old)) == trained_records(position)
        assert InputPosition.from_dict(dealt.to_dict(), "state") == dealt  # the file's form


def test_a_redeal_of_two_shards_to_three_names_each_new_shards_batches():
    # Shard 0 of 2 trained global 0, 2, 4 (its seqs 0..2), shard 1 of 2 global 1, 3 (0..1).
    position = InputPosition(2, {0: StreamPosition(3), 1: StreamPosition(2)}, order=ORDER)
    dealt = redeal(position, 3)
    # Global 0..4 trained: shard 0 of 3 has 0, 3 (seqs 0, 1), shard 1 has 1, 4, shard 2 has 2.
    assert {s: (p.next, p.above) for s, p in dealt.streams.items()} == {
        0: (2, set()), 1: (2, set()), 2: (1, set())}  # fmt: skip
    # Only shard 1 of 2's seq 1 (global 3): shard 0 of 3's seq 1 is trained, its seq 0 not.
    alone = InputPosition(2, {1: StreamPosition(0, {1})}, order=ORDER)
    assert redeal(alone, 3).streams[0].to_dict() == {"next": 0, "above": [1], "end": None}


def _cluster_union(rng: random.Random, workers: int, per_worker: int, steps: int,
                   epochs: int) -> InputPosition:
    """A cluster's union after ``steps`` lockstep steps: each worker trained one batch a step
    from its own producer's shards (``worker_info``: group ``w`` holds shards ``w, w+K,
    ...``), each shard one stream of ``epochs`` epochs, the batches taken nearly in arrival
    order (two enqueue threads: a few holes)."""
    shards = workers * per_worker
    position = InputPosition(shards, order=ORDER)
    for worker in range(workers):
        mine = [worker + i * workers for i in range(per_worker)]
        length = {s: epochs * ORDER.shard_batches(s, shards) for s in mine}
        arrived = [(s, seq) for seq in range(max(length.values())) for s in mine
                   if seq < length[s]]  # fmt: skip
        window = arrived[: steps + rng.randint(0, 3)]
        for shard, seq in rng.sample(window, steps):
            position.streams.setdefault(shard, StreamPosition()).add(seq)
    return position


def _left_per_group(position: InputPosition, groups: int, epochs: int) -> list[int]:
    """Untrained batches of each group ``g`` of ``groups`` (its shards ``g, g+groups, ...``)."""
    left = [0] * groups
    for shard in range(position.shards):
        stream = position.streams.get(shard, StreamPosition())
        total = epochs * ORDER.shard_batches(shard, position.shards)
        trained = stream.next + len(stream.above)
        left[shard % groups] += total - trained
    return left


@pytest.mark.parametrize(
    ("workers", "per_worker", "new_workers", "new_per_worker"),
    [(2, 1, 2, 2), (2, 2, 2, 1), (2, 1, 2, 3), (2, 2, 2, 5), (4, 1, 2, 3), (4, 2, 1, 1),
     (2, 3, 1, 2)],
)  # fmt: skip
def test_a_clusters_checkpoint_dealt_out_again_leaves_each_worker_as_many(
    workers, per_worker, new_workers, new_per_worker
):
    """Workers in lockstep, resumed with another producer count a worker, on the same number
    of workers or on one that divides it: with the interleaved groups every worker has as
    many batches left, so a cluster, which stops at the step where the first worker has none,
    trains them all (the promise matrix's cluster chain failed with blocks of shards: 35 and
    37 left, 2 batches never trained)."""
    rng = random.Random(workers * 1000 + per_worker * 100 + new_workers * 10 + new_per_worker)
    per_epoch = ORDER.batches // workers  # each old worker's share of an epoch
    for _ in range(40):
        steps = rng.randint(1, 2 * per_epoch - 1)
        union = _cluster_union(rng, workers, per_worker, steps, epochs=2)
        dealt = redeal(union, new_workers * new_per_worker)
        left = _left_per_group(dealt, new_workers, epochs=2)
        expected = (2 * ORDER.batches - workers * steps) // new_workers
        assert left == [expected] * new_workers, (steps, left)
        check_even(union, new_workers, "the checkpoint")  # what the cluster checks at start


def test_blocks_of_shards_would_leave_the_workers_unequal_data():
    """Why groups interleave: a checkpoint like the matrix's (shard 0 trained below 11 and 12,
    shard 1 below 12; two epochs as one stream) dealt out to 4 shards leaves the interleaved
    groups 12 batches each, blocks (shards 0-1, 2-3) 11 and 13: the cluster would stop after
    11 more steps, 2 batches of the second worker never trained."""
    union = InputPosition(2, order=ORDER)
    union.streams[0] = StreamPosition(11, {12})
    union.streams[1] = StreamPosition(12)
    dealt = redeal(union, 4)
    assert _left_per_group(dealt, 2, epochs=2) == [12, 12]
    blocks = [0, 0]
    for shard, left in enumerate(_left_per_group(dealt, 4, epochs=2)):
        blocks[shard // 2] += left
    assert blocks == [11, 13]


def test_a_checkpoint_that_leaves_workers_unequal_batches_is_refused_naming_it():
    """One trainer's checkpoint of two shards, shard 0 trained further (a faster producer):
    on two workers, worker 0 (the even global batches) would have fewer left. Refused in one
    line naming the checkpoint; fine on one trainer, and when the shards are even."""
    uneven = InputPosition(2, order=ORDER)
    uneven.streams[0] = StreamPosition(5)
    uneven.streams[1] = StreamPosition(2)
    with pytest.raises(ConfigError) as info:
        check_even(uneven, 2, "the checkpoint ckpt/state-000007.json")
    assert str(info.value).startswith(
        "the checkpoint ckpt/state-000007.json cannot resume exactly on 2 trainer workers: its "
        "workers' groups of shards hold [5, 2] trained batches"
    )
    check_even(uneven, 1, "x")
    uneven.streams[1] = StreamPosition(5)
    check_even(uneven, 2, "x")
    # Without an order the shards stay: group w holds shards w, w+K, ...
    plain = InputPosition(4)
    for shard, trained in enumerate([3, 1, 2, 2]):
        plain.streams[shard] = StreamPosition(trained)
    with pytest.raises(ConfigError, match=r"hold \[5, 3\] trained batches"):
        check_even(plain, 2, "x")
    plain.streams[1] = StreamPosition(3)
    check_even(plain, 2, "x")
    with pytest.raises(ConfigError, match=r"hold \[3, 3, 2, 2\] trained batches"):
        check_even(plain, 4, "x")


def test_what_cannot_be_dealt_out_again_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="no data order"):
        redeal(InputPosition(2, {0: StreamPosition(3)}), 3)
    with pytest.raises(ConfigError, match="approximate"):
        redeal(InputPosition(2, approximate={1}, order=ORDER), 3)
    wrong_pass = InputPosition(2, {0: StreamPosition(12, passes=[11])}, order=ORDER)
    with pytest.raises(ConfigError, match="pass ends"):
        redeal(wrong_pass, 3)


def test_an_order_out_of_bounds_in_a_file_is_refused_naming_it():
    good = ORDER.to_dict()
    for bad in ({**good, "records": 0}, {**good, "seed": -1}, {**good, "shuffle": 1},
                {**good, "batch_size": 97}, {**good, "source": ""}, {**good, "x": 1}):  # fmt: skip
        with pytest.raises(ConfigError, match="state order"):
            DataOrder.from_dict(bad, "state order")
    assert "seed 5" in ORDER.differs(DataOrder("npy:ids.npy", 96, 4, 6, True))
    assert ORDER.differs(DataOrder(**good)) is None


def _resumed_intake(position: InputPosition) -> Intake:
    ledger = Ledger(shards=ShardBooks(resumed=position))
    options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1,
                             producer_timeout_s=60.0)  # fmt: skip
    intake = Intake(options, SCHEMA, Recorder(), ledger).start()
    intake.ledger = ledger
    return intake


def _order_fields(order: DataOrder) -> dict:
    return hello_fields(order.source, order.records, order.seed, order.shuffle)


def test_a_hello_of_another_count_and_the_same_order_gets_the_position_dealt_out(peers):
    order = DataOrder("npy:ids.npy", 96, SCHEMA.batch_size, 5, True)
    position = InputPosition(2, {0: StreamPosition(3), 1: StreamPosition(2)}, order=order)
    intake = _resumed_intake(position)
    welcome = _hello(peers(intake), 2, 3, **_order_fields(order))
    assert welcome["t"] == "welcome" and welcome["start"] == 1  # global 2 was trained
    assert intake.ledger.shards.position().shards == 3
    first = peers(intake)
    assert _hello(first, 0, 3, **_order_fields(order))["start"] == 2
    _send(first, [2])
    # A batch was admitted under 3 shards: a hello of 2 is refused, naming both counts.
    late = _hello(peers(intake), 0, 2, **_order_fields(order))
    assert late["t"] == "refused" and late["reason"] == "shard"
    assert "cannot be dealt out again" in late["detail"] and "came first" in late["detail"]


def test_a_producer_of_another_seed_or_without_an_order_is_refused_naming_the_runs(peers):
    order = DataOrder("npy:ids.npy", 96, SCHEMA.batch_size, 5, True)
    intake = _resumed_intake(InputPosition(2, {0: StreamPosition(3)}, order=order))
    other = DataOrder("npy:ids.npy", 96, SCHEMA.batch_size, 6, True)
    same_count = _hello(peers(intake), 0, 2, **_order_fields(other))
    assert same_count["t"] == "refused" and same_count["reason"] == "shard"
    assert "seed 6" in same_count["detail"] and "seed 5" in same_count["detail"]
    assert _hello(peers(intake), 0, 3, **_order_fields(other))["t"] == "refused"
    unordered = _hello(peers(intake), 1, 2)
    assert unordered["t"] == "refused" and "names no data order" in unordered["detail"]
    assert intake.ledger.shards.position().shards == 2  # nothing was dealt out


def test_the_hellos_order_fields_are_checked_on_the_wire():
    fields = _order_fields(ORDER)
    hello = dict(name="p", schema=None, shard=0, shards=1, seek=True)
    kinds = protocol.FROM_PRODUCER
    header = protocol.decode_header(protocol.encode_control("hello", **hello, **fields), kinds)
    assert header["order_records"] == 96
    for bad in ({**fields, "order_seed": -1}, {**fields, "order_records": 0},
                {k: v for k, v in fields.items() if k != "order_shuffle"}):  # fmt: skip
        raw = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "hello", **hello, **bad})
        with pytest.raises(ProtocolError, match="header_fields"):
            protocol.decode_header(raw, kinds)
