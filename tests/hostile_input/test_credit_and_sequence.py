"""The connection's state: a message before hello, batches without credit or in a burst
past it, a replayed batch, forged and far sequence numbers, and idle connections that would
hoard the credit pool."""

from __future__ import annotations

import time

import pytest
import zmq

from stagefeed.common import protocol
from tests.conftest import wait_for
from tests.helpers import procs
from tests.hostile import wire
from tests.hostile.peers import Peer
from tests.hostile_input.harness import (
    Case,
    H,
    W,
    check_cases,
    check_dropped,
    check_still_training,
    delta,
    new_peer,
    one,
    require,
)

pytestmark = pytest.mark.slow  # starts TensorFlow in a subprocess


# -- the connection's state: hello, credit, sequence -----------------------------------------


def test_message_before_hello_is_refused_no_hello(target):
    messages = {"batch": wire.good_frames(0), "end": wire.control("end", seq=3),
                "ping": wire.control("ping")}  # fmt: skip
    start = target.metrics()
    for key, frames in messages.items():
        p = new_peer(target, hello=False)
        check_dropped(target, p, one(key, frames, "no_hello"))
        assert p.wait(lambda p=p: len(p.refusals) == 1), key
        assert p.refusals[0]["reason"] == "no_hello", key
        assert p.credit == 0, key
        if key == "batch":  # a batch also gets its verdict, so the producer counts the loss
            assert p.wait(lambda p=p: len(p.verdicts) == 1), "no verdict for the batch"
            assert (p.verdicts[0]["seq"], p.verdicts[0]["reason"]) == (0, "no_hello")
        else:
            assert not p.verdicts, key
    check_still_training(target, start)


def test_batch_without_credit_gets_a_dropped_verdict(target, peer):
    # After ``end`` a connection has no credit and is granted none: every batch is unasked for.
    peer.send(wire.control("end", seq=0))
    frames = [wire.good_frames(0), wire.good_frames(1)]
    check_cases(target, [Case("after-end", frames, {"no_credit": 2})], peer)
    assert peer.wait(lambda: len(peer.verdicts) == 2), peer.verdicts
    assert [(v["seq"], v["reason"]) for v in peer.verdicts] == [(0, "no_credit"), (1, "no_credit")]
    assert target.metrics().received.get(peer.name, 0) == 0


def test_burst_past_the_credit_is_dropped_no_credit(target, peer):
    """Valid batches sent without waiting for credit: never more accepted than granted."""
    before = target.metrics()
    sent = 12
    for seq in range(sent):
        peer.send(wire.good_frames(seq))

    def refused(m: procs.Metrics) -> int:
        return delta(m.dropped, before.dropped).get("no_credit", 0)

    def settled(m: procs.Metrics) -> bool:  # each batch is received, or dropped with a verdict
        if target.good is None:  # no per-producer labels: until the verdicts stop coming
            return peer.pump(1.0) == 0 and refused(m) == len(peer.verdicts)
        return refused(m) + m.received.get(peer.name, 0) >= sent

    after = target.wait(settled)
    dropped = refused(after)
    assert peer.wait(lambda: len(peer.verdicts) >= dropped), f"{dropped} verdicts not all in"
    accepted = sent - dropped

    def granted_so_far() -> int:
        return peer.welcome["credit"] + sum(r["n"] for r in peer.replies if r["t"] == "credit")

    # Every grant that let a batch in went out before that batch was handled, and may still
    # be on its way: wait for as many as were accepted (if fewer ever come, more were
    # accepted than granted).
    peer.wait(lambda: granted_so_far() >= accepted)
    granted = granted_so_far()
    if target.good is not None:
        assert after.received.get(peer.name, 0) == accepted
    assert delta(after.dropped, before.dropped) == {"no_credit": dropped}
    assert 1 <= accepted <= granted
    assert [v["reason"] for v in peer.verdicts] == ["no_credit"] * dropped
    target.booked.update({"no_credit": dropped})
    check_still_training(target, after)


def test_replayed_message_is_dropped_as_duplicate(target, peer):
    frames = wire.good_frames(0)
    peer.send_batch(frames)
    check_cases(target, [one("replay", frames, "duplicate", credit=True)], peer)
    assert peer.verdicts[-1]["seq"] == 0
    assert target.metrics().received.get(peer.name, 1) == 1


def test_forged_max_seq_cannot_touch_the_good_producers_books(target, peer):
    """v1: one forged batch carrying a real producer's id and seq 2**63-1 locked it out. In v2
    a header names no producer: the batch lands in the sender's own books, nowhere else."""
    before = target.metrics()
    peer.send_batch(wire.good_frames(2**63 - 1))
    after = target.wait(lambda m: m.received.get(peer.name, 0) == 1)
    if target.good is not None:
        assert after.received[peer.name] == 1
        assert after.missing.get(peer.name, 0) == 0
    # Naming the good producer in a header is an extra field, dropped before the batch checks.
    check_cases(target, [
        one("producer-field", W(H(seq=2**63 - 1, producer=target.good or "good")),
            "header_fields"),
    ], peer)  # fmt: skip
    for _ in range(2):  # its trained count keeps growing, with no gap and no duplicate
        after = check_still_training(target, after)
    assert delta(after.dropped, before.dropped) == {"header_fields": 1}
    assert not peer.verdicts


def test_a_peer_claiming_the_good_producers_name_renames_and_links_nothing(target):
    """A name is a label anyone can claim: a hello with the good producer's name, then a batch
    with seq 2**63-1, opens books of its own under ``name#index``. The good producer's series
    keep their label and their counts, and no sequence hole appears anywhere (before: the
    genuine series became ``name#0`` and ``seq_missing`` read 9.2e18)."""
    require(target.good is not None, "needs per-producer metric labels")
    before = target.metrics()
    impostor = new_peer(target, name=target.good)
    impostor.send_batch(wire.good_frames(2**63 - 1))
    mine = [k for k in target.wait(lambda m: len(m.received) > len(before.received)).received
            if k not in before.received]  # fmt: skip
    assert len(mine) == 1 and mine[0].startswith(f"{target.good}#"), mine
    after = check_still_training(target, before)  # under its own, unchanged label
    assert after.received[mine[0]] == 1 and not impostor.verdicts
    assert after.trained[target.good] > before.trained[target.good]
    assert sum(after.missing.values()) == sum(before.missing.values()), after.missing
    impostor.send(wire.control("end", seq=1))


def test_seq_far_past_the_window_is_seq_range_and_does_not_move_it(target, peer):
    peer.send_batch(wire.good_frames(0))
    target.wait(lambda m: m.received.get(peer.name, 0) == 1)
    check_cases(target, [one("2**63-1", wire.good_frames(2**63 - 1), "seq_range", credit=True),
                         one("0+2**16+1", wire.good_frames(2**16 + 1), "seq_range",
                             credit=True)], peer)  # fmt: skip
    assert [v["seq"] for v in peer.verdicts] == [2**63 - 1, 2**16 + 1]
    peer.send_batch(wire.good_frames(1))  # in the window: still accepted
    peer.send_batch(wire.good_frames(2**16))  # the edge of the window: accepted too
    if target.good is not None:
        after = target.wait(lambda m: m.received.get(peer.name, 0) == 3)
        assert after.received[peer.name] == 3
        assert after.missing.get(peer.name, 0) == 2**16 + 1 - 3
    assert len(peer.verdicts) == 2


def test_seq_far_before_the_window_is_seq_range(target, peer):
    peer.send_batch(wire.good_frames(2**63 - 1))  # a connection's first seq opens its window
    m = target.wait(lambda m: m.received.get(peer.name, 0) == 1)
    require(m.received.get(peer.name, 0) == 1, "the first batch was not received")
    before = target.metrics()
    peer.send_batch(wire.good_frames(0))
    after = target.wait(
        lambda m: m.received.get(peer.name, 0) == 2 or bool(delta(m.dropped, before.dropped))
    )
    target.booked.update(delta(after.dropped, before.dropped))
    assert after.missing.get(peer.name, 0) == 0, "seq_missing of the connection"
    assert delta(after.dropped, before.dropped) == {"seq_range": 1}


def test_idle_connections_cannot_hoard_the_credit_pool():
    """In-process intake (the credit pool is the thing under test); hoarders come first."""
    from stagefeed.common.options import TrainerOptions
    from stagefeed.common.schema import ArraySpec, Schema
    from stagefeed.consumer.books.ledger import Ledger
    from stagefeed.consumer.intake.intake import Intake

    schema = Schema((ArraySpec("x", "float32", (3,)),), 2)
    timeout_s = 2.0
    options = TrainerOptions(bind="tcp://127.0.0.1:*", schema=schema, queue_mb=1,
                             producer_timeout_s=timeout_s)  # fmt: skip
    got: list[int] = []
    intake = Intake(options, schema, lambda a, i, s: got.append(s) is None, Ledger()).start()
    ctx = zmq.Context()
    try:
        hoarders = [Peer(ctx, intake.endpoint, timeout_s=5) for _ in range(2)]
        granted = [h.hello(f"hoarder-{i}")["credit"] for i, h in enumerate(hoarders)]
        require(sum(granted) == intake.credit_pool, f"hoarders were granted {granted}")
        good = Peer(ctx, intake.endpoint, timeout_s=5)
        require(good.hello("good")["t"] == "welcome", "the good producer was refused")
        deadline = time.monotonic() + 3 * timeout_s
        while good.credit == 0 and time.monotonic() < deadline:
            for h in hoarders:  # still here: keeps their credit alive
                h.send(wire.control("ping"))
                h.pump()
            good.send(wire.control("ping"))
            good.pump(0.5)
        assert good.credit > 0, f"no credit for the good producer in {3 * timeout_s:.0f} s"
        good.send_batch(protocol.encode_batch(0, wire.valid_arrays(schema)))
        assert wait_for(lambda: got == [0], 5), f"the good producer's batch: {got}"
    finally:
        intake.close()
        ctx.destroy(linger=0)
