"""A producer that finished stays until a checkpoint holds its whole shard (docs/resume.md,
"A producer that finished"): the trainer's ``saved``, the producer's ``leaving``, over a real
intake and raw DEALER peers on loopback.

The books (``ShardBooks``) stand where the trainer's checkpoints would call ``saved``; the
intake, its dispatch and the protocol are the things under test. The whole path, killed
trainers and producers that rewind, is ``tests/test_resume.py`` and
``tests/test_resume_cluster.py``.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from stagefeed.common import protocol
from stagefeed.common.options import TrainerOptions
from stagefeed.common.position import InputPosition
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.books.shard_books import ShardBooks
from stagefeed.consumer.intake.intake import Intake
from tests.test_intake import GOOD, SCHEMA, Recorder, _holds_within, _reply, _wait

# Resumed from a checkpoint that holds all of shard 0 (3 batches) and batch 0 of shard 1.
RESUMED = {
    "version": 1, "shards": 2, "approximate": [],
    "streams": {"0": {"next": 3, "above": [], "end": 3},
                "1": {"next": 1, "above": [], "end": None}},
}  # fmt: skip


def _intake(confirms: bool) -> Intake:
    ledger = Ledger()
    ledger.shards = ShardBooks(InputPosition.from_dict(RESUMED, "test"), confirms=confirms)
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1, producer_timeout_s=30.0
    )
    recorder = Recorder()
    intake = Intake(options, SCHEMA, recorder, ledger).start()
    intake.books, intake.recorder = ledger.shards, recorder
    return intake


@pytest.fixture
def peers():
    ctx = zmq.Context()
    started: list[Intake] = []

    def connect(intake: Intake) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(intake.endpoint)
        if intake not in started:
            started.append(intake)
        return sock

    yield connect
    for intake in started:
        intake.close()
    ctx.destroy(linger=0)


def _hello(sock, shard: int, confirm: bool = True) -> dict:
    fields = {"confirm": True} if confirm else {}
    sock.send(protocol.encode_control(
        "hello", name=f"shard-{shard}", schema=SCHEMA.to_dict(), shard=shard, shards=2,
        seek=True, **fields,
    ))  # fmt: skip
    return _reply(sock)


def _next(sock, kind: str, timeout_s: float = 10.0) -> dict:
    """The next message of ``kind`` (credits and the like in between are skipped)."""
    while True:
        header = _reply(sock, timeout_s)
        if header["t"] == kind:
            return header


def _got(sock, kind: str, window_s: float) -> bool:
    """Whether a message of ``kind`` comes within ``window_s`` (a negative check's window)."""
    seen: list[str] = []

    def look() -> bool:
        while sock.poll(0):
            seen.append(protocol.decode_header(sock.recv(), protocol.FROM_TRAINER)["t"])
        return kind in seen

    return _holds_within(look, window_s)


def test_the_books_say_a_shard_is_saved_whole_only_once_a_saved_position_holds_all_of_it():
    books = ShardBooks(InputPosition.from_dict(RESUMED, "test"), confirms=True)
    assert books.saved_end(0) == 3  # the checkpoint resumed from counts as saved
    assert books.saved_end(1) is None  # not ended
    assert books.admit(1, 1) is None and books.admit(1, 2) is None
    assert books.ended(1, 2, 3) is None
    books.trained(1, 2)  # batch 1 still missing: not whole
    books.saved(books.position())
    assert books.saved_end(1) is None
    books.trained(1, 1)
    assert books.saved_end(1) is None  # trained, not yet in a saved checkpoint
    saves = books.saves
    books.saved(books.position())
    assert books.saved_end(1) == 3 and books.saves == saves + 1


def test_a_finished_shard_is_told_saved_once_a_checkpoint_holds_it_and_not_before(peers):
    intake = _intake(confirms=True)
    partial, whole = peers(intake), peers(intake)
    welcome = _hello(partial, 1)
    assert (welcome["start"], welcome["confirm"]) == (1, True)
    for seq in (1, 2):
        partial.send_multipart(protocol.encode_batch(seq, GOOD))
    _wait(lambda: len(intake.recorder.got) == 2, "2 batches enqueued")
    partial.send(protocol.encode_control("end", seq=3))
    _wait(lambda: intake.books.position().of(1).end == 3, "the end booked")
    for seq in (1, 2):
        intake.books.trained(1, seq)  # trained (as the train loop books it), not yet saved
    assert not _got(partial, "saved", 0.5)
    intake.books.saved(intake.books.position())  # the checkpoint that holds them is written
    assert _next(partial, "saved")["seq"] == 3

    # An end after the last checkpoint, of a shard the checkpoint resumed from holds whole.
    welcome = _hello(whole, 0)
    assert (welcome["start"], welcome["confirm"]) == (3, True)
    whole.send(protocol.encode_control("end", seq=3))
    assert _next(whole, "saved") == {"v": 2, "t": "saved", "seq": 3}


def test_no_confirm_unless_both_sides_say_so(peers):
    plain = _intake(confirms=False)  # a ServedFeed without confirm_saves: nobody says saved
    sock = peers(plain)
    welcome = _hello(sock, 0)
    assert "confirm" not in welcome and welcome["start"] == 3
    sock.send(protocol.encode_control("end", seq=3))
    assert not _got(sock, "saved", 0.5)

    confirming = _intake(confirms=True)
    old = peers(confirming)  # a producer that does not ask (one from before ``confirm``)
    welcome = _hello(old, 0, confirm=False)
    assert "confirm" not in welcome
    old.send(protocol.encode_control("end", seq=3))
    assert not _got(old, "saved", 0.5)


def test_a_closing_intake_waits_for_leaving_from_a_producer_told_saved(peers):
    intake = _intake(confirms=True)
    sock = peers(intake)
    disconnects = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    _hello(sock, 0)
    sock.send(protocol.encode_control("end", seq=3))
    _next(sock, "saved")
    closing = threading.Thread(target=intake.close, name="test-intake-close")
    closing.start()
    try:
        assert _next(sock, "bye") == {"v": 2, "t": "bye"}
        # Told saved, no leaving yet: the intake keeps the connection (2 s at most), so that
        # the saved message is not lost with it.
        assert not _holds_within(lambda: disconnects.poll(0), 0.5)
        sock.send(protocol.encode_control("leaving"))
        assert disconnects.poll(10_000), "the intake kept the connection after leaving"
    finally:
        closing.join(30)
        sock.disable_monitor()
        disconnects.close(linger=0)
    assert not closing.is_alive()


def test_the_bye_of_a_finished_run_lets_a_waiting_producer_go(peers):
    intake = _intake(confirms=True)
    waiting, plain = peers(intake), peers(intake)
    _hello(waiting, 1)
    for seq in (1, 2):  # received, never trained: the shard is not whole
        waiting.send_multipart(protocol.encode_batch(seq, GOOD))
    waiting.send(protocol.encode_control("end", seq=3))
    _hello(plain, 0, confirm=False)
    _wait(lambda: intake.books.position().of(1).end == 3, "the end booked")
    intake.books.saved(intake.books.position(), finished=True)  # e.g. its --steps were done
    assert not _got(waiting, "saved", 0.5)
    closing = threading.Thread(target=intake.close, name="test-intake-close")
    closing.start()
    try:
        assert _next(waiting, "bye") == {"v": 2, "t": "bye", "finished": True}
        assert _next(plain, "bye") == {"v": 2, "t": "bye"}
        waiting.send(protocol.encode_control("leaving"))
    finally:
        closing.join(30)
    assert not closing.is_alive()
