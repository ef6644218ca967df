"""Fuzzing the trainer's intake in-process: Hypothesis frame lists over a real loopback ROUTER.

``consumer.intake.Intake`` runs with its real sockets and threads and a recording enqueue
callable (a real collaborator: it keeps what the intake hands over). Each example sends one
generated multipart message from a DEALER: the connection that said hello at the start, or a
fresh one (which may say a generated hello itself). After each example a probe connection
sends a valid batch against its credit, and it must be enqueued: the intake thread never dies
(``intake.check()`` never raises), nothing is booked as ``internal`` (an unexpected exception),
and no message is booked twice. Examples per run follow the Hypothesis profile
(``tests/fuzz_strategies.py``: ``quick`` by default, ``fuzz`` for ``make fuzz``).
"""

from __future__ import annotations

import threading

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stagefeed.common import protocol
from stagefeed.common.ledger import Ledger
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import MAX_ARRAYS, ArraySpec, Schema
from stagefeed.consumer.intake import Intake

from tests.fuzz_strategies import header_bytes, schema_dicts
from tests.hostile import wire
from tests.hostile.peers import Peer
from tests.test_fuzz_protocol import batch_messages

SCHEMA = Schema((ArraySpec("x", "float32", (3,)), ArraySpec("y", "int32", (), bounds=(0, 10))), 2)
PROBE_S = 10.0  # a valid batch is enqueued within this, whatever came before


class Recorder:
    """The enqueue callable: (connection index, seq) of every batch, with a condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.got: list[tuple[int, int]] = []

    def __call__(self, arrays: dict, index: int, seq: int) -> bool:
        assert list(arrays) == list(SCHEMA.names)
        with self.cond:
            self.got.append((index, seq))
            self.cond.notify_all()
        return True

    def wait_for(self, item: tuple[int, int], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: item in self.got, timeout)


class Rig:
    def __init__(self) -> None:
        self.ledger = Ledger()
        self.recorder = Recorder()
        options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1)
        self.intake = Intake(options, SCHEMA, self.recorder, self.ledger).start()
        self.ctx = zmq.Context()
        self.probe = self.peer()
        assert self.probe.hello("probe")["t"] == "welcome"
        self.probe_index = self.ledger.producer_count() - 1
        self.fuzzer = self.peer()
        assert self.fuzzer.hello("fuzzer")["t"] == "welcome"
        self.sent = 0  # messages sent, each booked at most once (a drop or a batch received)
        self.probe_seq = 0

    def peer(self) -> Peer:
        return Peer(self.ctx, self.intake.endpoint, timeout_s=PROBE_S)

    def check_alive(self) -> None:
        """The intake still works: the probe's next valid batch is enqueued."""
        self.intake.check()
        seq, self.probe_seq = self.probe_seq, self.probe_seq + 1
        self.probe.send_batch(protocol.encode_batch(seq, wire.valid_arrays(SCHEMA)))
        self.sent += 1
        assert self.recorder.wait_for((self.probe_index, seq), PROBE_S), "probe not enqueued"
        self.intake.check()
        drops = self.ledger.drops_by_reason()
        assert "internal" not in drops, drops
        assert sum(drops.values()) + self.ledger.totals().received <= self.sent


@pytest.fixture(scope="module")
def rig():
    r = Rig()
    yield r
    r.intake.check()
    r.intake.close()
    r.ctx.destroy(linger=0)


@st.composite
def messages(draw) -> list[bytes]:
    """One multipart message: a bent header, a bent batch, a generated hello, or junk frames."""
    how = draw(st.sampled_from(["header", "batch", "batch", "hello", "frames"]))
    if how == "batch":
        return draw(batch_messages())[1]
    if how == "hello":
        name = draw(st.one_of(st.just("fuzz"), st.text(max_size=70)))
        schema = draw(st.one_of(st.none(), st.just(SCHEMA.to_dict()), schema_dicts()))
        try:
            return wire.hello(name, schema)
        except (ValueError, TypeError, OverflowError):  # msgpack cannot pack it: junk then
            return [b"\xc1"]
    head = draw(header_bytes())
    if how == "header":
        return [head]
    return [head, *draw(st.lists(st.binary(max_size=256), max_size=MAX_ARRAYS + 4))]


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                 HealthCheck.too_slow])  # fmt: skip
@given(frames=messages(), sender=st.sampled_from(["fuzzer", "fuzzer", "fresh"]))
def test_the_intake_survives_any_message_and_keeps_enqueueing(rig, frames, sender):
    if sender == "fuzzer":
        rig.fuzzer.send(frames)
        rig.fuzzer.pump()  # its verdicts and credits: read, not kept waiting in ZeroMQ
        rig.sent += 1
    else:
        fresh = rig.peer()
        fresh.send(frames)
        # A fresh connection whose generated hello was welcomed holds credit: hand it back.
        fresh.send(wire.control("end", seq=0))
        rig.sent += 2
        fresh.sock.close(linger=2000)  # delivered after the close, in the background
    rig.check_alive()
