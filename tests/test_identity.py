"""Books belong to the connection: no name, header field or routing id reaches another's books.

Most tests run the trainer's real intake (``consumer.intake.intake.Intake``, its ROUTER on loopback,
its ``Ledger``) in-process with a recording enqueue callable (a real collaborator: it keeps
what the intake hands over, with the connection index the intake chose), and real DEALER
connections from ``tests.hostile.peers.Peer``. With CURVE keys (``stagefeed keygen``), a
connection's books are labelled by the key ZAP admitted it with. The last test checks the same
labels on a real ``stagefeed train --curve-keys`` process, in its metrics and JSON summary.
"""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from stagefeed.common import curve, protocol
from stagefeed.common.curve import key_fingerprint
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.intake import Intake
from stagefeed.keygen import write_keys
from tests.conftest import TINY, wait_for
from tests.helpers import procs
from tests.hostile import wire
from tests.hostile.good_producer import start_good_producer
from tests.hostile.peers import Peer

SCHEMA = Schema((ArraySpec("x", "float32", (3,)), ArraySpec("y", "int32", (), bounds=(0, 10))), 2)
WAIT_S = 10.0


class Recorder:
    """The intake's enqueue callable: keeps (connection index, seq) of every batch handed over."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: list[tuple[int, int]] = []

    def __call__(self, arrays: dict, index: int, seq: int) -> bool:
        assert set(arrays) == set(SCHEMA.names)
        with self.lock:
            self.got.append((index, seq))
        return True

    def seqs_of(self, index: int) -> list[int]:
        with self.lock:
            return sorted(s for i, s in self.got if i == index)

    def wait_count(self, count: int) -> bool:
        return wait_for(lambda: len(self.got) >= count, WAIT_S, interval=0.01)


class Running:
    """An intake on loopback with its ledger and recorder; peers connect to ``endpoint``."""

    def __init__(self, configure_server=None) -> None:
        self.options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=1)
        self.ledger = Ledger()
        self.recorder = Recorder()
        self.intake = Intake(
            self.options, SCHEMA, self.recorder, self.ledger, configure_server
        ).start()
        self.endpoint = self.intake.endpoint
        self.ctx = zmq.Context()
        self.peers: list[Peer] = []

    def peer(self, configure=None, routing_id: bytes | None = None) -> Peer:
        def setup(sock: zmq.Socket) -> None:
            if routing_id is not None:
                sock.setsockopt(zmq.ROUTING_ID, routing_id)
            if configure is not None:
                configure(sock)

        p = Peer(self.ctx, self.endpoint, configure=setup, timeout_s=WAIT_S)
        self.peers.append(p)
        return p

    def close(self) -> None:
        for p in self.peers:
            p.close()
        self.intake.check()
        self.intake.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def running():
    r = Running()
    yield r
    r.close()


def batch(seq: int) -> list[bytes]:
    return [bytes(f) for f in protocol.encode_batch(seq, wire.valid_arrays(SCHEMA))]


def send_valid(p: Peer, seqs, end: bool = False) -> None:
    """Valid batches against credit; ``end``: then say so, handing unused credit back."""
    for seq in seqs:
        p.send_batch(batch(seq))
    if end:
        p.send(wire.control("end", seq=max(seqs) + 1))


def books(r: Running) -> dict[str, dict]:
    return r.ledger.summary()


def settle(r: Running, received: int) -> None:
    """Wait until the ledger has ``received`` valid batches and the recorder has them all."""
    assert wait_for(lambda: r.ledger.totals().received >= received, WAIT_S, interval=0.01), (
        f"the ledger received {r.ledger.totals().received} of {received} in {WAIT_S} s"
    )
    assert r.recorder.wait_count(received), (
        f"the intake handed over {len(r.recorder.got)} of {received} in {WAIT_S} s"
    )


def test_two_connections_claiming_one_name_get_separate_books(running):
    a, b = running.peer(), running.peer()
    assert a.hello("twin")["t"] == "welcome"
    assert b.hello("twin")["t"] == "welcome"
    send_valid(a, [0, 1, 2])
    send_valid(b, [0, 1])  # the same sequence numbers: no duplicate, they are other books
    settle(running, 5)
    summary = books(running)
    twins = {k: v for k, v in summary.items() if k.startswith("twin")}
    assert len(twins) == 2, summary
    assert sorted(v["received"] for v in twins.values()) == [2, 3]
    assert all(v["dropped"] == {} and v["seq_duplicates"] == 0 for v in twins.values())
    assert all(v["seq_missing"] == 0 for v in twins.values())
    # The enqueued batches carry two connection indices, each with its own sequence.
    indices = sorted({i for i, _ in running.recorder.got})
    assert len(indices) == 2
    assert sorted(running.recorder.seqs_of(i) for i in indices) == [[0, 1], [0, 1, 2]]


def test_no_header_field_writes_into_another_connections_books(running):
    victim, attacker = running.peer(), running.peer()
    victim.hello("victim")
    send_valid(victim, [0, 1, 2])
    settle(running, 3)
    [victim_index] = {i for i, _ in running.recorder.got}
    before = books(running)["victim"]
    attacker.hello("attacker")
    forged = [
        {"producer": "victim"}, {"name": "victim"}, {"index": victim_index},
        {"peer": victim_index}, {"routing_id": b"\x00\x00\x00\x00\x01"}, {"id": "victim"},
        {"user_id": "victim"}, {"connection": victim_index}, {"key": "victim"},
    ]  # fmt: skip
    for fields in forged:
        attacker.send(wire.with_header(wire.header(seq=3, **fields), *_xy()))
    # The victim's next sequence numbers, and ones it already used, sent by the attacker:
    # booked under the attacker, no duplicate nor gap on the victim.
    send_valid(attacker, [2, 3, 4])
    # A second hello on the attacker's connection naming the victim keeps the attacker's books.
    assert attacker.hello("victim")["t"] == "welcome"
    send_valid(attacker, [5])
    settle(running, 7)
    assert wait_for(
        lambda: books(running)["attacker"]["dropped"].get("header_fields") == len(forged), WAIT_S
    ), f"the attacker's forged headers not all dropped in {WAIT_S} s: {books(running)}"
    summary = books(running)
    assert summary["victim"] == {**before, "active_s": summary["victim"]["active_s"]}
    attacker_books = summary["attacker"]
    assert attacker_books["received"] == 4
    assert attacker_books["dropped"] == {"header_fields": len(forged)}
    assert attacker_books["seq_first"] == 2 and attacker_books["seq_last"] == 5
    assert running.recorder.seqs_of(victim_index) == [0, 1, 2]
    # The victim goes on as if nothing happened.
    send_valid(victim, [3, 4])
    settle(running, 9)
    final = books(running)["victim"]
    assert final["received"] == 5 and final["seq_duplicates"] == 0 and final["seq_missing"] == 0
    assert final["dropped"] == {}
    assert running.recorder.seqs_of(victim_index) == [0, 1, 2, 3, 4]


def _xy() -> tuple[bytes, bytes]:
    (_, x), (_, y) = wire.valid_arrays(SCHEMA)
    return x.tobytes(), y.tobytes()


def test_a_claimed_routing_id_cannot_take_over_a_connection(running):
    """A DEALER may pick its routing id; the trainer's ROUTER ignores a second peer claiming
    one in use, so the claimant reaches nothing and the first connection keeps its books."""
    first = running.peer(routing_id=b"producer-1")
    assert first.hello("first")["t"] == "welcome"
    send_valid(first, [0])
    settle(running, 1)
    claimant = running.peer(routing_id=b"producer-1")
    claimant.send(wire.hello("claimant"))
    claimant.send(batch(1))
    claimant.send(wire.with_header(wire.header(seq=1, arrays=[]), b""))
    assert claimant.pump(1.0) == 0, claimant.replies  # no welcome: its messages reach nothing
    send_valid(first, [1, 2])
    settle(running, 3)
    summary = books(running)
    assert list(summary) == ["first"], summary
    assert summary["first"]["received"] == 3 and summary["first"]["dropped"] == {}
    assert running.ledger.drops_by_reason() == {}


def test_a_new_connection_under_an_old_name_opens_new_books(running):
    old = running.peer()
    old.hello("again")
    send_valid(old, [0, 1])
    settle(running, 2)
    old.close()
    new = running.peer()
    assert new.hello("again")["t"] == "welcome"
    send_valid(new, [0, 1])  # not duplicates: another connection, other books
    settle(running, 4)
    summary = books(running)
    assert sorted(summary) == ["again", "again#1"], summary  # the first keeps its key
    assert all(v["received"] == 2 and v["seq_duplicates"] == 0 for v in summary.values())


def test_a_batch_before_hello_books_nothing_under_any_name(running):
    owner = running.peer()
    owner.hello("owner")
    stranger = running.peer()
    stranger.send(batch(0))
    assert stranger.wait(lambda: bool(stranger.refusals)), "no refusal of a batch before hello"
    assert stranger.refusals[0]["reason"] == "no_hello"
    # The reply goes out before the drop is booked.
    assert wait_for(lambda: running.ledger.drops_by_reason() == {"no_hello": 1}, WAIT_S), (
        running.ledger.drops_by_reason()
    )
    summary = books(running)
    assert summary["owner"]["dropped"] == {} and summary["owner"]["received"] == 0
    assert summary["<unidentified>"]["dropped"] == {"no_hello": 1}


def stop_first(trainer: procs.Trainer, producer, *peers: Peer) -> None:
    """Stop the producers before the trainer, so no batch is in flight when it stops: until
    the trainer has seen each of them go and its queue is empty (it took every batch it
    received, so no enqueue is waiting for room)."""
    gone = procs.disconnections_of(trainer.metrics()) + 1 + len(peers)
    for peer in peers:
        peer.send(wire.control("end", seq=1))
        peer.close()
    producer.signal()
    assert producer.wait(30) == 0, procs.log_text(producer)
    settled = trainer.wait_metrics(
        lambda m: (
            procs.disconnections_of(m) >= gone and m.samples[("stagefeed_queue_batches", ())] == 0
        ),
        60,
    )
    assert procs.disconnections_of(settled) >= gone, (
        f"the trainer saw {procs.disconnections_of(settled)} of {gone} go"
    )
    assert settled.samples[("stagefeed_queue_batches", ())] == 0, "the trainer's queue is not empty"


# -- CURVE: books labelled by the key ------------------------------------------------------------


@pytest.fixture
def keys(tmp_path) -> str:
    path = str(tmp_path / "keys")
    write_keys(path, 2)
    return path


def public_key(keys: str, client: str) -> str:
    return curve.load_key_pair(os.path.join(keys, client, "client.key_secret"))[0].decode()


def test_with_curve_books_are_labelled_by_the_key(keys):
    r = Running(curve.server_configurator(keys))
    try:
        k0 = curve.client_configurator(os.path.join(keys, "client-0"))
        k1 = curve.client_configurator(os.path.join(keys, "client-1"))
        pub0, pub1 = public_key(keys, "client-0"), public_key(keys, "client-1")
        a, b, a2 = r.peer(k0), r.peer(k1), r.peer(k0)
        for p in (a, b, a2):
            assert p.hello("twin")["t"] == "welcome"
        # A connection with key 1 naming itself after key 0's label gets a label of its own.
        mimic = r.peer(k1)
        assert mimic.hello(f"twin {key_fingerprint(pub0)}")["t"] == "welcome"
        # Four connections share a pool of four credits: each hands its own back when done.
        send_valid(a, [0, 1, 2], end=True)
        send_valid(b, [0, 1], end=True)
        send_valid(a2, [0], end=True)
        send_valid(mimic, [0], end=True)
        settle(r, 7)
        summary = books(r)
        label0 = f"twin {key_fingerprint(pub0)}"  # the first keeps it, the second gets #i
        # (only a "#" and digits after it are ours)
        by_key0 = {
            k: v for k, v in summary.items()
            if k == label0 or (k.startswith(label0 + "#") and k[len(label0) + 1 :].isdigit())
        }  # fmt: skip
        assert sorted(v["received"] for v in by_key0.values()) == [1, 3], summary
        assert summary[f"twin {key_fingerprint(pub1)}"]["received"] == 2
        assert summary[f"twin {key_fingerprint(pub0)} {key_fingerprint(pub1)}"]["received"] == 1
        assert all(v["seq_duplicates"] == 0 and v["dropped"] == {} for v in summary.values())
    finally:
        r.close()


@pytest.mark.slow
def test_trainer_labels_books_and_metrics_by_curve_key(tmp_path, keys):
    """A real ``stagefeed train --curve-keys``: the good producer (key client-0) and a
    connection with key client-1 claiming the same name are booked apart, labelled by key."""
    spawn = procs.Spawner(tmp_path)
    ctx = zmq.Context()
    try:
        trainer = procs.Trainer(spawn, "--curve-keys", keys)
        pub0, pub1 = public_key(keys, "client-0"), public_key(keys, "client-1")
        producer = start_good_producer(
            spawn, trainer.endpoint, "4", tiny=TINY, curve_keys=os.path.join(keys, "client-0")
        )
        live = trainer.wait_metrics(lambda m: any(v >= 2 for v in m.trained.values()), 120)
        [good] = [k for k, v in live.trained.items() if v >= 2]
        assert good.endswith(f" {key_fingerprint(pub0)}"), good
        name = good[: -len(f" {key_fingerprint(pub0)}")]
        other = Peer(
            ctx,
            trainer.endpoint,
            configure=curve.client_configurator(os.path.join(keys, "client-1")),
        )
        assert other.hello(name)["t"] == "welcome"
        other.send_batch(wire.good_frames(0))
        mimic_label = f"{name} {key_fingerprint(pub1)}"
        live = trainer.wait_metrics(lambda m: m.received.get(mimic_label, 0) == 1, 30)
        assert live.received[mimic_label] == 1
        was = live.trained[good]
        assert trainer.wait_metrics(lambda m: m.trained.get(good, 0) > was, 30).trained[good] > was
        # See test_a_batch_in_flight_at_stop_does_not_hang_the_intake.
        stop_first(trainer, producer, other)
        summary = trainer.stop()
        assert summary["producers"][good]["seq_missing"] == 0
        assert summary["producers"][good]["dropped"] == {}
        assert summary["producers"][mimic_label]["received"] == 1
    finally:
        spawn.kill_all()
        ctx.destroy(linger=0)
