"""A peer's message whose handling fails, and a seq no position can hold (consumer/intake/
dispatch.py): the peer is always answered, the drop is booked by reason, and the intake goes
on. A real intake with raw DEALER peers (tests/test_shard_claims.py's setting); the books
(``ShardBooks``) stand where a ServedFeed with ``resume`` keeps them.
"""

from __future__ import annotations

import pytest
import zmq

from stagefeed.common import protocol
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import MAX_SEQ, InputPosition, StreamPosition
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.books.shard_books import ShardBooks
from stagefeed.consumer.intake.intake import Intake
from tests.test_intake import GOOD, SCHEMA, Recorder, _reply, _wait


@pytest.fixture
def served():
    """``(serve, connect)``: ``serve(books)`` starts an intake booking into ``books``;
    ``connect(intake)`` a DEALER peer of it."""
    ctx = zmq.Context()
    started: list[Intake] = []

    def serve(books: ShardBooks) -> tuple[Intake, Recorder, Ledger]:
        recorder = Recorder()
        opts = TrainerOptions(bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1,
                              producer_timeout_s=60.0)  # fmt: skip
        ledger = Ledger(shards=books)
        intake = Intake(opts, SCHEMA, recorder, ledger).start()
        started.append(intake)
        return intake, recorder, ledger

    def connect(intake: Intake) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(intake.endpoint)
        return sock

    yield serve, connect
    for intake in started:
        intake.close()
    ctx.destroy(linger=0)


def _hello(sock: zmq.Socket, name: str, **shard) -> dict:
    sock.send(protocol.encode_control("hello", name=name, schema=SCHEMA.to_dict(), **shard))
    while True:
        header = _reply(sock)
        if header["t"] in ("welcome", "refused"):
            return header


def test_a_hello_whose_handling_raises_is_refused_with_the_reason_and_the_intake_goes_on(
    served,
):
    """Before: the welcome of a shard whose position (a user's ``InputPosition``, not read
    from a file) starts past what the wire can say raised ``OverflowError`` while encoding,
    nothing was sent, and the producer waited for ever ('no reply from the intake')."""
    serve, connect = served
    huge = InputPosition(1, {0: StreamPosition(next=2**64)})
    intake, _, ledger = serve(ShardBooks(huge))
    sock = connect(intake)
    reply = _hello(sock, "shard-0", shard=0, shards=1, seek=True)
    assert reply["t"] == "refused" and reply["reason"] == "internal", reply
    assert "failed while handling this hello" in reply["detail"]
    assert ledger.read().dropped == {"internal": 1}
    other = connect(intake)  # the intake is alive: a producer naming no shard is served
    assert _hello(other, "no-shard")["t"] == "welcome"
    intake.check()


def test_a_batch_whose_seq_no_position_can_hold_is_dropped_not_admitted(served):
    """Before: a shard's first batch at seq 2**60 was admitted (in flight, then trained into
    the position, whose file then failed to load: every count is at most 2**53)."""
    serve, connect = served
    books = ShardBooks()
    intake, recorder, ledger = serve(books)
    sock = connect(intake)
    assert _hello(sock, "shard-0", shard=0, shards=1, seek=True)["t"] == "welcome"
    sock.send_multipart(protocol.encode_batch(MAX_SEQ, GOOD))
    while (reply := _reply(sock))["t"] != "dropped":
        pass
    assert reply["seq"] == MAX_SEQ and reply["reason"] == "seq_range", reply
    assert "below 2**53" in reply["detail"]
    sock.send_multipart(protocol.encode_batch(0, GOOD))  # its credit came back
    _wait(lambda: len(recorder.got) == 1, "the batch of seq 0 enqueued")
    assert [seq for _, seq in recorder.got] == [0]
    assert books.welcome(0) == (1, [])  # nothing of MAX_SEQ is in flight or trained
    assert ledger.read().dropped == {"seq_range": 1}
