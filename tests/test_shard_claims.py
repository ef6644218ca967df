"""A shard's identity is an input (consumer/intake/claims.py, docs/guarantees.md): who may carry
a shard, what settles the shard count, and whose ends count, over a real intake with raw
DEALER peers (tests/test_saved_confirm.py's setting) and real ``produce`` processes.

The books (``ShardBooks``) stand where a ``--save`` trainer keeps them; the intake, its
dispatch and the protocol are the things under test.
"""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from stagefeed.common import protocol
from stagefeed.common.options import TrainerOptions
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.books.shard_books import ShardBooks
from stagefeed.consumer.intake.intake import Intake
from tests.helpers import resume_models
from tests.helpers.procs import log_text
from tests.test_intake import GOOD, SCHEMA, Recorder, _reply, _wait

TIMEOUT_S = 60


class Enqueued:
    """The intake's enqueue: records (peer, seq) of every batch, of any schema."""

    def __init__(self) -> None:
        self.got: list[tuple[int, int]] = []

    def __call__(self, arrays, peer: int, seq: int) -> bool:
        self.got.append((peer, seq))
        return True


def _intake(schema=SCHEMA, books: bool = True, enqueue=None, joined_only: bool = False,
            **options) -> Intake:  # fmt: skip
    enqueue = enqueue or Recorder()
    ledger = Ledger(shards=ShardBooks(joined_only=joined_only) if books else None)
    opts = TrainerOptions(bind="tcp://127.0.0.1:*", schema=schema, queue_mb=1,
                          producer_timeout_s=60.0, **options)  # fmt: skip
    intake = Intake(opts, schema, enqueue, ledger).start()
    intake.ledger, intake.recorder = ledger, enqueue
    return intake


@pytest.fixture
def peers():
    ctx = zmq.Context()
    started: list[Intake] = []

    def connect(intake: Intake) -> zmq.Socket:
        if intake not in started:
            started.append(intake)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(intake.endpoint)
        return sock

    yield connect
    for intake in started:
        intake.close()
    ctx.destroy(linger=0)


def _hello(sock, shard: int, shards: int, schema=SCHEMA, **fields) -> dict:
    sock.send(protocol.encode_control(
        "hello", name=f"peer-{shard}-of-{shards}", schema=schema.to_dict(), shard=shard,
        shards=shards, seek=True, **fields,
    ))  # fmt: skip
    while True:
        header = _reply(sock)
        if header["t"] in ("welcome", "refused"):
            return header


def _send(sock, seqs) -> None:
    for seq in seqs:  # credit: the intake grants 2 per producer, and they return quickly
        sock.send_multipart(protocol.encode_batch(seq, GOOD))
        time.sleep(0.05)


def test_a_hello_that_leaves_settles_no_shard_count_and_real_producers_feed_the_run(
    peers, start_cli
):
    """Before: a peer's hello as shard 0 of 4096, gone without a batch, fixed the count of a
    fresh ``--save`` run and every genuine producer was refused and exited 2."""
    enqueued = Enqueued()
    intake = _intake(resume_models.SCHEMA, enqueue=enqueued)
    stray = peers(intake)
    stray.send(protocol.encode_control("hello", name="stray", schema=None, shard=0,
                                       shards=4096, seek=True))  # fmt: skip
    assert _reply(stray)["t"] == "welcome"
    stray.close()
    producers = start_cli(["produce", "--connect", intake.endpoint, "--workers", "2",
                           "--schema", "tests.helpers.resume_models:SCHEMA",
                           "--source", "tests.helpers.resume_models:rows"],
                               name="producers")  # fmt: skip
    assert producers.wait(TIMEOUT_S * 2) == 0, log_text(producers)[-3000:]
    per_shard = len(resume_models.stream(0, 2))
    assert len(enqueued.got) == 2 * per_shard
    assert intake.ledger.shards.shards == 2  # settled by the first batch
    late = peers(intake)  # now the count is settled: another one is refused, naming it
    refused = _hello(late, 0, 4096, resume_models.SCHEMA)
    assert refused["reason"] == "shard" and "trained so far has 2 shards" in refused["detail"]


def test_a_live_shard_is_carried_by_one_connection_and_taken_over_once_it_is_gone(peers):
    """Before: a second connection naming a live producer's shard had its batches trained,
    and the owner's own batches of those seqs were dropped (already_trained, duplicate) and
    counted again as seq_missing."""
    intake = _intake()
    owner, intruder = peers(intake), peers(intake)
    assert _hello(owner, 0, 1)["t"] == "welcome"
    _send(owner, [0, 1])
    refused = _hello(intruder, 0, 1)
    assert refused["t"] == "refused" and refused["reason"] == "shard_taken"
    assert "live connection of producer peer-0-of-1" in refused["detail"]
    intruder.send_multipart(protocol.encode_batch(2, GOOD))  # not welcomed: refused again
    _send(owner, [2, 3])
    _wait(lambda: len(intake.recorder.got) == 4, "the owner's 4 batches enqueued")
    books = intake.ledger.read()
    assert books.refused == {"shard_taken": 1}
    assert books.dropped == {"no_hello": 1}  # the intruder's batch, none of the owner's
    assert books.totals.seq_missing == 0 and sorted(s for _, s in intake.recorder.got) == [
        0, 1, 2, 3]  # fmt: skip
    # The owner goes: its connection closes, and the next claim takes over at once (not
    # after --producer-timeout-s, 60 s here) from the position.
    owner.close()
    successor = peers(intake)
    started = time.monotonic()
    while (welcome := _hello(successor, 0, 1))["t"] != "welcome":
        assert time.monotonic() - started < 10, welcome
        time.sleep(0.2)
    assert welcome["start"] == 4


def test_a_restarted_producer_gets_its_shard_back_after_kill_9(start_cli, caplog):
    """``produce`` killed with SIGKILL and started again: its old connection is gone, so the
    new one carries the shard at once (the trainer probes the old one when the claim comes;
    a claim refused before that says hello again every second), long before the
    60 s producer timeout; every batch of the stream is enqueued once, in all."""
    caplog.set_level(logging.INFO, logger="stagefeed.consumer.intake")
    enqueued = Enqueued()
    intake = _intake(resume_models.SCHEMA, enqueue=enqueued)
    try:
        args = ["produce", "--connect", intake.endpoint, "--workers", "1",
                "--schema", "tests.helpers.resume_models:SCHEMA", "--source",
                    "tests.helpers.resume_models:rows"]
        first = start_cli([*args, "--rate", "10"], name="first")
        _wait(lambda: len(enqueued.got) >= 5, "5 batches of the first producer", TIMEOUT_S)
        first.kill_group()
        killed_at = len(enqueued.got)
        again = start_cli(args, name="again")
        started = time.monotonic()
        assert again.wait(TIMEOUT_S * 2) == 0, log_text(again)[-3000:]
        assert time.monotonic() - started < 45, "the restarted producer waited for its shard"
        seqs = sorted(seq for _, seq in enqueued.got)
        assert seqs == list(range(len(resume_models.stream(0, 1)))), (killed_at, seqs)
        assert "takes over shard 0" in caplog.text  # the old connection was still booked
    finally:
        intake.close()


def test_a_producer_whose_shard_is_carried_is_told_why_and_carries_it_once_it_is_free(
    peers, start_cli
):
    """A second ``produce`` of a shard (a forgotten --shard-group) learns why it is refused,
    says hello again every second, and takes over from the position once the shard is free."""
    enqueued = Enqueued()
    intake = _intake(resume_models.SCHEMA, enqueue=enqueued)
    holder = peers(intake)
    assert _hello(holder, 0, 1, resume_models.SCHEMA)["t"] == "welcome"
    second = start_cli(["produce", "--connect", intake.endpoint, "--workers", "1",
                        "--schema", "tests.helpers.resume_models:SCHEMA",
                        "--source", "tests.helpers.resume_models:rows"], name="second")  # fmt: skip
    _wait(lambda: "refused our shard" in log_text(second), "the refusal said", TIMEOUT_S)
    assert "carried by the live connection of producer peer-0-of-1" in log_text(second)
    assert second.proc.poll() is None and enqueued.got == []
    holder.close()
    assert second.wait(TIMEOUT_S * 2) == 0, log_text(second)[-3000:]
    assert sorted(s for _, s in enqueued.got) == list(range(len(resume_models.stream(0, 1))))


def test_an_end_counts_only_from_the_owner_at_the_shards_reach(peers):
    """Before: a peer that sent nothing could end shard 0 at 2**62 (the run waited for ever,
    and the end went into the state file)."""
    intake = _intake()
    books = intake.ledger.shards
    liar = peers(intake)
    assert _hello(liar, 0, 1)["t"] == "welcome"
    liar.send(protocol.encode_control("end", seq=2**62))
    _wait(lambda: intake.ledger.read().dropped.get("shard_end") == 1, "the end dropped")
    assert books.position().of(0).end is None
    liar.close()
    genuine = peers(intake)
    started = time.monotonic()
    while (welcome := _hello(genuine, 0, 1))["t"] != "welcome":
        assert time.monotonic() - started < 10, welcome
        time.sleep(0.2)
    _send(genuine, [0, 1, 2])
    genuine.send(protocol.encode_control("end", seq=3))
    _wait(lambda: books.position().of(0).end == 3, "the genuine end booked")
    assert books.missing() == {}


@pytest.mark.parametrize(("other", "shards", "group"),
                         [(1, 2, {}), (2, 4, {"group_stride": 2})],
                         ids=["block", "interleaved"])  # fmt: skip
def test_a_cluster_worker_waits_for_the_other_shards_of_a_produce_command_that_joined(
    peers, other, shards, group
):
    """A cluster worker waits only for shards that joined it (``joined_only``). Before: shard
    0 of a ``produce --workers 2`` delivered and ended before its other shard connected, and
    the worker's data had ended: the other shard, connecting later, was stranded. Its hello's
    group (``group_first``, ``group_shards``, and ``group_stride``: 1, a block, if absent; the
    number of groups from a ``produce`` of today) now names both, and the worker waits."""
    intake = _intake(joined_only=True)
    books = intake.ledger.shards
    first = peers(intake)
    fields = {"group_first": 0, "group_shards": 2, **group}
    assert _hello(first, 0, shards, **fields)["t"] == "welcome"
    _send(first, [0, 1])
    first.send(protocol.encode_control("end", seq=2))
    _wait(lambda: books.position().of(0).end == 2, "shard 0's end booked")
    assert books.missing() == {other: 0}
    time.sleep(0.5)  # the intake looks at the end of the data after every message
    assert not intake.data_ended()
    assert str(other) not in books.position().to_dict()["streams"]  # expected, not there
    late = peers(intake)
    assert _hello(late, other, shards, **fields)["t"] == "welcome"
    _send(late, [0, 1])
    late.send(protocol.encode_control("end", seq=2))
    _wait(intake.data_ended, "the data ended once the other shard ended too")
    assert books.missing() == {}


@pytest.mark.parametrize(
    ("shard", "shards", "group", "named"),
    [(2, 4, (0, 2, 1), "0..1"), (1, 2, (0, 3, 1), "0..2"), (1, 4, (0, 2, 2), "0..2, every 2"),
     (0, 4, (0, 3, 2), "0..4, every 2")],
    ids=["shard-outside", "group-past-shards", "shard-between", "interleaved-past-shards"],
)  # fmt: skip
def test_a_hello_whose_group_does_not_hold_its_shard_is_refused(peers, shard, shards, group,
                                                                named):  # fmt: skip
    intake = _intake(joined_only=True)
    first, count, stride = group
    fields = {"group_first": first, "group_shards": count}
    if stride > 1:
        fields["group_stride"] = stride
    refused = _hello(peers(intake), shard, shards, **fields)
    assert refused["t"] == "refused" and refused["reason"] == "shard", refused
    assert f"is not in its group {named}" in refused["detail"]


@pytest.mark.parametrize("save", [True, False], ids=["save", "no-save"])
def test_a_pass_end_counts_only_at_the_reach_and_its_lines_are_throttled(peers, caplog, save):
    """Before: each ``end_pass`` logged a line (3,000 messages, 3,001 lines), and one from a
    peer that sent nothing wrote a pass end into the shard's position."""
    intake = _intake(books=save, epochs=2)

    def ends() -> list[int]:
        if save:
            return intake.ledger.shards.position().of(0).passes
        return intake.passes.ends.get(0, [])

    sock = peers(intake)
    assert _hello(sock, 0, 1, passes=True)["t"] == "welcome"
    sock.send(protocol.encode_control("end_pass", seq=2**40, **{"pass": 0}))  # sent nothing
    _wait(lambda: intake.ledger.read().dropped.get("shard_end") == 1, "the pass end dropped")
    assert ends() == []
    _send(sock, [0, 1])
    _wait(lambda: len(intake.recorder.got) == 2, "2 batches enqueued")
    sock.send(protocol.encode_control("end_pass", seq=3, **{"pass": 0}))  # past its reach
    caplog.set_level(logging.INFO, logger="stagefeed.consumer.intake")
    for _ in range(3000):
        sock.send(protocol.encode_control("end_pass", seq=2, **{"pass": 0}))
    _wait(lambda: ends() == [2], "the pass end booked")
    time.sleep(1.0)  # the 3,000 are read by now (one intake thread, in order, ~ms each)
    assert intake.ledger.read().dropped == {"shard_end": 2}
    lines = [r for r in caplog.records if "ended pass" in r.getMessage()]
    assert 1 <= len(lines) <= 3, len(lines)
