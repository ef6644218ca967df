"""The intake over real loopback sockets: hello, credit, verdicts, identity, bounded receipt.

The intake (its ROUTER socket, threads, connections and books) is the thing under test; the
enqueue it is given is a plain function that records what it got, standing in for the queue.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import msgpack
import numpy as np
import pytest
import zmq

from stagefeed.common import protocol
from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.frames import receive_message
from stagefeed.consumer.intake.intake import Intake

SCHEMA = Schema(
    (ArraySpec("x", "float32", (4,)), ArraySpec("y", "int64", (), bounds=(0, 10))), 2
)
GOOD = [("x", np.ones((2, 4), np.float32)), ("y", np.array([1, 2], np.int64))]


class Recorder:
    """Records what it was given; clear ``open`` to hold enqueues (no credit comes back)."""

    def __init__(self) -> None:
        self.got: list[tuple[int, int]] = []
        self.lock = threading.Lock()
        self.open = threading.Event()
        self.open.set()

    def __call__(self, arrays, peer: int, seq: int) -> bool:
        assert set(arrays) == {"x", "y"}
        assert self.open.wait(30), "held for 30 s"
        with self.lock:
            self.got.append((peer, seq))
        return True


@pytest.fixture
def intake():
    ledger = Ledger()
    recorder = Recorder()
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1, producer_timeout_s=5.0
    )
    it = Intake(options, SCHEMA, recorder, ledger).start()
    it.recorder, it.ledger = recorder, ledger
    ctx = zmq.Context()
    it.ctx = ctx
    yield it
    it.close()
    ctx.destroy(linger=0)


def _peer(intake) -> zmq.Socket:
    sock = intake.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(intake.endpoint)
    return sock


def _reply(sock, timeout_s: float = 10.0) -> dict:
    assert sock.poll(int(timeout_s * 1000)), "no reply from the intake; " + _stacks()
    return protocol.decode_header(sock.recv(), protocol.FROM_TRAINER)


def _stacks() -> str:
    """Where this process's threads are: an intake that did not answer once under the full
    suite (never alone) says what its thread was doing."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "threads:\n" + "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)[-8:])
        for ident, frame in sys._current_frames().items()
    )


def _replies(sock, until, timeout_s: float = 10.0) -> list[dict]:
    """Replies read until ``until(replies)`` holds (credits may come merged in one message)."""
    got: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while not until(got) and time.monotonic() < deadline:
        if sock.poll(50):
            got.append(protocol.decode_header(sock.recv(), protocol.FROM_TRAINER))
    assert until(got), f"replies in {timeout_s} s: {got}"
    return got


def _credit(replies: list[dict]) -> int:
    return sum(r["n"] for r in replies if r["t"] == "credit")


def _hello(sock, name="p-1", schema=None) -> dict:
    sock.send(protocol.encode_control("hello", name=name, schema=schema))
    return _reply(sock)


def _holds_within(predicate, seconds: float) -> bool:
    """Whether ``predicate`` holds at some poll within ``seconds`` (a negative check's window,
    taken only once a positive condition showed the input under test was processed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _wait(predicate, what: str, timeout_s: float = 10.0) -> None:
    """Poll until ``predicate`` holds; fail saying ``what`` was awaited if it does not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    assert predicate(), f"waited {timeout_s} s for {what}"


def test_hello_gets_the_schema_and_credit_then_batches_are_enqueued(intake):
    sock = _peer(intake)
    welcome = _hello(sock)
    assert welcome["t"] == "welcome" and Schema.from_dict(welcome["schema"]) == SCHEMA
    assert welcome["credit"] == 2 and welcome["max_message"] == intake.options.max_message_bytes
    for seq in range(2):
        sock.send_multipart(protocol.encode_batch(seq, GOOD))
    _wait(lambda: len(intake.recorder.got) == 2, "2 batches enqueued")
    replies = _replies(sock, lambda r: _credit(r) >= 2)
    assert _credit(replies) == 2  # one credit back per batch handled, no more
    assert intake.ledger.totals().enqueued == 2
    intake.check()


def test_a_producer_declaring_another_schema_is_refused_naming_the_array(intake):
    sock = _peer(intake)
    other = Schema((ArraySpec("x", "float64", (4,)), SCHEMA["y"]), 2)
    refused = _hello(sock, schema=other.to_dict())
    assert refused == {
        "v": 2, "t": "refused", "reason": "spec_mismatch",
        "detail": "x: the trainer expects float32[2,4], the producer declared float64[2,4]",
    }  # fmt: skip
    assert intake.ledger.refusals() == {"p-1": {"spec_mismatch": 1}}


def test_a_batch_before_hello_or_without_credit_is_dropped_and_the_producer_told(intake):
    sock = _peer(intake)
    sock.send_multipart(protocol.encode_batch(0, GOOD))
    assert _reply(sock)["reason"] == "no_hello"
    _hello(sock)
    # Enqueues held: no credit comes back for the first two while the third arrives (a fast
    # enqueue could otherwise return one first, and the third would be covered by it).
    intake.recorder.open.clear()
    for seq in range(3):  # two credits granted: the third is not
        sock.send_multipart(protocol.encode_batch(seq, GOOD))
    verdicts = _replies(sock, lambda r: any(v["t"] == "dropped" for v in r))
    intake.recorder.open.set()
    verdicts += _replies(sock, lambda r: _credit(verdicts + r) >= 2)
    dropped = [v for v in verdicts if v["t"] == "dropped"]
    assert [(v["seq"], v["reason"]) for v in dropped] == [(2, "no_credit")]
    assert intake.ledger.drops_by_reason() == {"no_hello": 1, "no_credit": 1}


def test_a_bad_batch_is_refused_with_its_reason_and_its_credit_returns(intake):
    sock = _peer(intake)
    _hello(sock)
    bad = [("x", np.ones((2, 4), np.float32)), ("y", np.array([1, 99], np.int64))]
    sock.send_multipart(protocol.encode_batch(0, bad))
    verdicts = _replies(sock, lambda r: {v["t"] for v in r} == {"dropped", "credit"})
    dropped = next(v for v in verdicts if v["t"] == "dropped")
    assert dropped["reason"] == "value_range" and "y values span [1, 99]" in dropped["detail"]


def test_books_belong_to_the_connection_and_a_forged_seq_cannot_lock_anyone_out(intake):
    good, hostile = _peer(intake), _peer(intake)
    _hello(good, name="victim")
    _hello(hostile, name="victim")  # the same name: still its own books
    hostile.send_multipart(protocol.encode_batch(0, GOOD))
    hostile.send_multipart(protocol.encode_batch(2**63 - 1, GOOD))
    for seq in range(2):
        good.send_multipart(protocol.encode_batch(seq, GOOD))
    _wait(lambda: len(intake.recorder.got) == 3, "3 batches enqueued")
    summary = intake.ledger.summary()
    books = sorted((s["received"], s["dropped"]) for s in summary.values())
    assert books == [(1, {"seq_range": 1}), (2, {})]
    assert all(s["seq_missing"] == 0 for s in summary.values())


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([msgpack.packb({"v": 2, "t": "batch", "seq": 0, "arrays": 0})] + [b""] * 200_000,
         "parts"),
        ([msgpack.packb({"v": 2, "t": "batch", "seq": 0, "arrays": [[[[[[[[]]]]]]]] * 2}),
          b"a", b"b"], "header_fields"),
        ([b"\xc1" * 10], "header_not_msgpack"),
    ],
    ids=["200k empty frames", "nested arrays", "garbage"],
)
def test_hostile_messages_are_dropped_and_the_intake_goes_on(intake, frames, reason):
    sock = _peer(intake)
    _hello(sock)
    sock.send_multipart(frames)
    _wait(lambda: intake.ledger.drops_by_reason().get(reason) == 1, f"a {reason} drop", 30)
    sock.send_multipart(protocol.encode_batch(0, GOOD))
    _wait(lambda: len(intake.recorder.got) == 1, "the good batch after it enqueued")
    intake.check()


def test_the_frame_reader_keeps_at_most_its_limit_of_a_long_message():
    """What the intake holds of a message of 200k empty frames is its limit of frames (the
    rest read and let go), however many there are; they count, and the message is refused."""
    ctx = zmq.Context()
    try:
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        router.bind("tcp://127.0.0.1:*")
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        dealer.send_multipart([b"header"] + [b""] * 200_000)
        assert router.poll(30_000), "the 200k-frame message did not arrive in 30 s"
        message = receive_message(router, max_frames=17, max_bytes=2**20)
        assert (len(message.frames), message.count, message.total) == (17, 200_001, 6)
        with pytest.raises(ProtocolError) as refused:
            message.check(17, 2**20)
        assert refused.value.reason is DropReason.PARTS
    finally:
        ctx.destroy(linger=0)


def test_deeply_nested_header_cannot_stop_the_intake(intake):
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    sock = _peer(intake)
    _hello(sock)
    sock.send_multipart([msgpack.packb({"v": 2, "t": "batch", "seq": 0, "arrays": deep}), b"x"])
    _wait(lambda: intake.ledger.drops_by_reason().get("header_fields") == 1, "the drop")
    intake.check()


def test_data_ends_once_every_live_producer_said_end_and_all_was_handled(intake):
    a, b = _peer(intake), _peer(intake)
    _hello(a, name="a")
    _hello(b, name="b")
    a.send_multipart(protocol.encode_batch(0, GOOD))
    a.send(protocol.encode_control("end", seq=1))
    _wait(lambda: intake.ledger.summary()["a"]["ended_after"] == 1, "a's end booked")
    assert not intake.data_ended()  # b has not ended
    b.send(protocol.encode_control("end", seq=0))
    _wait(intake.data_ended, "the data to end")
    assert intake.recorder.got == [(0, 0)]


def test_a_defect_in_a_check_still_returns_the_credit_and_a_verdict(intake, monkeypatch):
    """An unexpected exception while checking a batch (a defect: every check raises
    ProtocolError) is booked ``internal``, and the batch still gets its ``dropped`` verdict
    and its credit back: a peer sending such batches cannot take the credit pool. The defect
    is planted in the decoder; the intake's handling of it is what is tested."""

    def broken_decoder(header, frames):
        raise RecursionError("planted defect")

    monkeypatch.setattr(protocol, "decode_batch", broken_decoder)
    sock = _peer(intake)
    credit = _hello(sock)["credit"]
    sent = 0
    for _ in range(3):  # 3 x 2 batches: more than the pool of 4 credits, one credit at a time
        for _ in range(credit):
            sock.send_multipart(protocol.encode_batch(sent, GOOD))
            sent += 1
        replies = _replies(
            sock, lambda r: _credit(r) >= credit and sum(v["t"] == "dropped" for v in r) == credit
        )
        assert {(v["reason"], v["detail"]) for v in replies if v["t"] == "dropped"} == {
            ("internal", "unexpected error")
        }
    assert intake.ledger.drops_by_reason() == {"internal": sent}
    monkeypatch.undo()
    sock.send_multipart(protocol.encode_batch(sent, GOOD))
    _wait(lambda: intake.recorder.got == [(0, sent)], "the good batch after the defect enqueued")
    intake.check()


@pytest.mark.parametrize(
    ("fields", "reason", "detail"),
    [
        ({"name": "bad\nname", "schema": None}, "hello", "producer name 'bad\\nname'"),
        ({"name": "", "schema": None}, "hello", "producer name ''"),
        ({"name": "p", "schema": {"arrays": 3}}, "hello", "'arrays' must list"),
        ({"name": 7, "schema": None}, "header_fields", "hello.name: 7"),
        ({"name": "p", "schema": None, "x": [[[[]]]]}, "header_fields", "unexpected [\"'x'\"]"),
    ],
    ids=["name with a newline", "empty name", "bad schema", "name an int", "extra field"],
)
def test_a_malformed_hello_is_refused_with_the_reason(intake, fields, reason, detail):
    sock = _peer(intake)
    sock.send(msgpack.packb({"v": 2, "t": "hello", **fields}))
    refused = _reply(sock)
    assert refused["t"] == "refused" and refused["reason"] == reason, refused
    assert detail in refused["detail"], refused
    assert intake.ledger.drops_by_reason() == {reason: 1}
    assert intake.ledger.producer_count() == 0  # no books for it


def test_only_a_producer_that_delivered_can_end_the_data(intake, caplog):
    """``end`` from a connection that delivered nothing ends nothing; from a producer run that
    delivered (on this connection, or on an earlier one with the same session token) it does."""
    caplog.set_level("INFO", logger="stagefeed.consumer.intake")
    idle = _peer(intake)
    _hello(idle, name="idle")
    idle.send(protocol.encode_control("end", seq=0))
    _wait(lambda: intake.ledger.summary()["idle"]["ended_after"] == 0, "idle's end booked")
    run = "ab" * 16
    first = _peer(intake)
    first.send(protocol.encode_control("hello", name="p", schema=None, session=run))
    assert _reply(first)["t"] == "welcome"
    first.send_multipart(protocol.encode_batch(0, GOOD))
    _wait(lambda: intake.recorder.got == [(1, 0)], "p's batch enqueued")
    first.close(linger=0)  # cut: forgotten once silent for producer_timeout_s (5 s here)
    stranger = _peer(intake)
    stranger.send(protocol.encode_control("hello", name="p", schema=None, session="cd" * 16))
    assert _reply(stranger)["t"] == "welcome"
    stranger.send(protocol.encode_control("end", seq=1))  # claims p's end: delivered nothing
    _wait(lambda: "producer p silent for 5 s: forgotten" in caplog.text, "p forgotten", 15)
    # Every live connection said end (the stranger's was sent before p's first connection was
    # forgotten, 5 s of intake loops ago), none that delivered: the data must not end. The
    # intake re-decides after every message and every poll: 2 s give it many chances to err.
    assert not _holds_within(intake.data_ended, 2.0)
    again = _peer(intake)  # the run that delivered, on a new connection
    again.send(protocol.encode_control("hello", name="p", schema=None, session=run))
    assert _reply(again)["t"] == "welcome"
    assert not intake.data_ended()
    again.send(protocol.encode_control("end", seq=1))
    _wait(intake.data_ended, "the data to end once the run that delivered said end")


def test_the_data_has_not_ended_while_a_sibling_of_an_ended_producer_never_connected(
    intake, caplog
):
    """Shard 0 of a ``produce --workers 2`` (its group: shards 0 and 1) delivers and ends
    before shard 1's process connects (a loaded host starts it late): the data has not ended
    until shard 1 said hello, delivered and ended too. Seen: a ``--steps 0`` trainer that
    stopped after 12 of 24 batches (tests/test_integration.py, beside a CPU hog)."""
    caplog.set_level("WARNING", logger="stagefeed.consumer.intake")

    def hello(sock, shard: int) -> None:
        sock.send(protocol.encode_control(
            "hello", name=f"p-{shard}", schema=None, shard=shard, shards=2, seek=False,
            group_first=0, group_shards=2,
        ))  # fmt: skip
        assert _reply(sock)["t"] == "welcome"

    first = _peer(intake)
    hello(first, 0)
    first.send_multipart(protocol.encode_batch(0, GOOD))
    first.send(protocol.encode_control("end", seq=1))
    _wait(lambda: intake.ledger.summary()["p-0"]["ended_after"] == 1, "p-0's end booked")
    assert not _holds_within(intake.data_ended, 2.0)
    assert "shards [1] of their produce commands never connected" in caplog.text
    second = _peer(intake)
    hello(second, 1)
    second.send_multipart(protocol.encode_batch(0, GOOD))
    second.send(protocol.encode_control("end", seq=1))
    _wait(intake.data_ended, "the data to end once both shards ended")
    assert len(intake.recorder.got) == 2  # one batch of each shard


def test_an_end_books_why_the_producer_left(intake, caplog):
    """A plain ``end`` is reason ok; ``source_error`` is booked with its detail and logged in
    one line naming the producer; an unknown reason is ``other``, its detail sanitised."""
    caplog.set_level("INFO", logger="stagefeed.consumer.books.ledger")
    ok, bad, odd = _peer(intake), _peer(intake), _peer(intake)
    for sock, name in ((ok, "ok-p"), (bad, "bad-p"), (odd, "odd-p")):
        _hello(sock, name=name)
    bad.send_multipart(protocol.encode_batch(0, GOOD))
    ok.send(protocol.encode_control("end", seq=0))
    detail = "source 'm:f' batch 1: y: value 99 outside [0, 10)"
    bad.send(protocol.encode_control("end", seq=1, reason="source_error", detail=detail))
    odd.send(msgpack.packb({"v": 2, "t": "end", "seq": 0, "reason": "x\n", "detail": "a\x1bb"}))
    _wait(lambda: intake.ledger.read().ended == {"ok": 1, "source_error": 1, "other": 1}, "ends")
    books = intake.ledger.summary()
    assert (books["bad-p"]["end_reason"], books["bad-p"]["end_detail"]) == ("source_error", detail)
    assert (books["ok-p"]["end_reason"], books["ok-p"]["end_detail"]) == ("ok", "")
    assert (books["odd-p"]["end_reason"], books["odd-p"]["end_detail"]) == ("other", "a b")
    assert sorted(intake.ledger.left(), key=lambda left: left["producer"]) == [
        {"producer": "bad-p", "reason": "source_error", "detail": detail, "ended_after": 1},
        {"producer": "odd-p", "reason": "other", "detail": "a b", "ended_after": 0},
    ]
    said = [r.getMessage() for r in caplog.records if "bad-p" in r.getMessage()]
    assert said[-1] == f"producer bad-p: end of data after 1 batches (source_error: {detail})"
    _wait(intake.data_ended, "the data to end: the producer that delivered said end")
    assert intake.recorder.got == [(1, 0)]  # its good batch was enqueued


@pytest.mark.parametrize(
    "fields",
    [
        {"seq": 0, "reason": "source_error", "detail": "x" * 100_000},  # over the header cap
        {"seq": 0, "reason": "source_error", "detail": "x" * 1000},  # over MAX_DETAIL_LEN
        {"seq": 0, "reason": ["source_error"] * 1000, "detail": "x"},
        {"seq": 0, "reason": "source_error", "detail": {"k": [[[[]]]]}},
        {"seq": 0, "reason": "source_error"},
    ],
    ids=["huge", "long", "reason-list", "detail-map", "half"],
)
def test_a_hostile_end_is_dropped_and_counted_and_the_intake_goes_on(intake, fields):
    sock = _peer(intake)
    _hello(sock, name="hostile")
    sock.send(msgpack.packb({"v": 2, "t": "end", **fields}))
    reason = "header_size" if len(str(fields.get("detail"))) > 16384 else "header_fields"
    _wait(lambda: intake.ledger.drops_by_reason() == {reason: 1}, "the drop")
    assert intake.ledger.summary()["hostile"]["end_reason"] is None  # not an end
    assert intake.ledger.read().ended == {}
    sock.send_multipart(protocol.encode_batch(0, GOOD))  # the connection still works
    _wait(lambda: intake.recorder.got == [(0, 0)], "the next batch enqueued")
    sock.send(protocol.encode_control("end", seq=1))
    _wait(lambda: intake.ledger.read().ended == {"ok": 1}, "the end after")
    intake.check()
