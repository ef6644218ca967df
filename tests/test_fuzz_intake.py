"""Fuzzing the trainer's intake in-process: Hypothesis frame lists over a real loopback ROUTER.

``consumer.intake.intake.Intake`` runs with its real sockets and threads, its shared-memory gate
(``--transport shm``, so ``shm_batch`` descriptors are parsed) and a recording enqueue
callable (a real collaborator: it keeps what the intake hands over). Each example sends one
generated multipart message from a DEALER: the connection that said hello at the start, or a
fresh one (which may say a generated hello itself). After each example a probe connection
sends a valid batch against its credit, and it must be enqueued: the intake thread never dies
(``intake.check()`` never raises), nothing is booked as ``internal`` (an unexpected exception),
and no message is booked twice. ``shm_batch`` messages whose descriptors are nested,
oversized or mistyped each get a ``dropped`` verdict and their credit back; ``end`` messages
so bent are refused or taken, never an error. Examples per run follow the Hypothesis profile
(``tests/helpers/fuzz_strategies.py``: ``quick`` by default, ``fuzz`` for ``make fuzz``).
"""

from __future__ import annotations

import threading

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagefeed.common import protocol
from stagefeed.common.errors import ProtocolError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import MAX_ARRAYS, ArraySpec, Schema
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.intake import Intake
from tests.helpers.fuzz_shm_strategies import end_headers, shm_batch_headers
from tests.helpers.fuzz_strategies import header_bytes, schema_dicts, trainer_recursion_limit
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
    def __init__(self, shm_socket: str) -> None:
        self.ledger = Ledger()
        self.recorder = Recorder()
        # 4 enqueue threads: a pool of 6 credits, 2 for each long-lived peer below. Those peers
        # are silent while the module's other tests run (under load, past the default 10 s of
        # --producer-timeout-s: CI saw the shm sender forgotten, its shm_batch dropped as
        # no_hello), so a silent connection is kept for the whole module.
        options = TrainerOptions(
            bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1, enqueue_threads=4,
            transport="shm", shm_socket=shm_socket, producer_timeout_s=3600.0,
        )  # fmt: skip
        self.intake = Intake(options, SCHEMA, self.recorder, self.ledger).start()
        self.ctx = zmq.Context()
        self.probe = self.peer()
        assert self.probe.hello("probe")["t"] == "welcome"
        self.probe_index = self.ledger.producer_count() - 1
        self.fuzzer = self.peer()
        assert self.fuzzer.hello("fuzzer")["t"] == "welcome"
        self.shm_sender = self.peer()  # sends only shm_batch messages, against its credit
        assert self.shm_sender.hello("shm-sender")["t"] == "welcome"
        self.shm_seq = 0
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
def rig(tmp_path_factory):
    r = Rig(str(tmp_path_factory.mktemp("fuzz-shm") / "pools.sock"))
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
    with trainer_recursion_limit():
        _send_and_check(rig, frames, sender)


def _send_and_check(rig, frames, sender) -> None:
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


SHM_REASONS = {"shm_descriptor", "shm_pool"}  # a descriptor of no pool this trainer mapped


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                 HealthCheck.too_slow])  # fmt: skip
@given(data=st.data())
def test_every_shm_batch_gets_a_verdict_and_its_credit_back(rig, data):
    """A ``shm_batch`` whose descriptor is right or bent (nested 1100 deep, oversized,
    mistyped, fields missing or extra) holds a credit: it must come back, with a ``dropped``
    verdict naming a shared-memory reason, however the descriptor fails."""
    seq, rig.shm_seq = rig.shm_seq, rig.shm_seq + 1
    raw = data.draw(shm_batch_headers(seq))
    with trainer_recursion_limit():
        _shm_batch_and_verdict(rig, seq, raw)


def _shm_batch_and_verdict(rig, seq: int, raw: bytes) -> None:
    peer = rig.shm_sender
    rig.sent += 1
    try:
        protocol.decode_header(raw, protocol.FROM_PRODUCER)
    except ProtocolError:  # a value msgpack or the field table refuses: not a shm_batch then,
        peer.send([raw])  # so it takes no credit (dropped as header_*, checked below)
        rig.check_alive()
        return
    assert peer.wait(lambda: peer.credit > 0), "no credit to send with"
    held = peer.credit
    peer.send_batch([raw])  # takes one credit
    verdicts = peer.verdict_for(seq)
    assert len(verdicts) == 1 and verdicts[0]["reason"] in SHM_REASONS, verdicts
    assert len(verdicts[0]["detail"]) <= protocol.MAX_DETAIL_LEN
    assert peer.wait(lambda: peer.credit >= held), f"its credit did not come back ({held})"
    rig.check_alive()


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                 HealthCheck.too_slow])  # fmt: skip
@given(raw=end_headers())
def test_a_bent_end_is_refused_or_taken_and_the_intake_goes_on(rig, raw):
    """``end`` from a connection that said hello, its ``seq`` nested, oversized or mistyped:
    dropped as ``header_fields`` or taken; never an error, and the intake keeps enqueueing."""
    with trainer_recursion_limit():
        fresh = rig.peer()
        assert fresh.hello("ends")["t"] == "welcome"
        fresh.send([raw])
        rig.sent += 1
        fresh.send(wire.control("end", seq=0))  # whatever happened, its credit goes back
        rig.sent += 1
        fresh.sock.close(linger=2000)
        rig.check_alive()
