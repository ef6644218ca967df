"""Deeply nested, oversized and mistyped values in the shared-memory path of a live trainer.

A slot descriptor or a pool announce is received data like a header: a value nested a
thousand deep must be refused like any other defect, under a ``ProtocolError`` reason, with
its credit back and a verdict (descriptors) or an answer (announces); it must never reach a
``repr`` (``RecursionError``), end the pools thread (the trainer would exit 3), or keep the
credit it came with (four such messages would take the whole credit pool, and the good
producer would wait for data forever).

The module's canary trainer (``tests.test_shm_hostile.live``, one per module) trains on a real
shared-memory producer all along; every case checks that it still does, and that nothing was
booked as ``internal``.
"""

from __future__ import annotations

import socket

import msgpack
import pytest

from stagefeed.common.shm.layout import SlotLayout
from stagefeed.common.shm.slots import SlotPool
from tests import test_shm_hostile
from tests.helpers.shm_canary import SCHEMA
from tests.test_shm_hostile import Live, Peer, counted

pytestmark = pytest.mark.slow  # TensorFlow in a subprocess

LAYOUT = SlotLayout.of(SCHEMA.wire())
live = test_shm_hostile.live  # the same fixture: one canary trainer for this module
DEPTH = 1000  # lists inside lists: past Python's repr recursion limit, within msgpack's


def nested(depth: int = DEPTH) -> bytes:
    """msgpack bytes of ``[[[...[0]...]]]``, ``depth`` lists deep."""
    return b"\x91" * depth + msgpack.packb(0)


def packed_map(fields: dict, raw: dict[str, bytes]) -> bytes:
    """A msgpack map of ``fields`` plus ``raw`` values given as packed bytes (nested deeper
    than msgpack's packer goes)."""
    assert len(fields) + len(raw) < 16
    out = bytes([0x80 | (len(fields) + len(raw))])
    for key, value in fields.items():
        out += msgpack.packb(key) + msgpack.packb(value)
    for key, value in raw.items():
        out += msgpack.packb(key) + value
    return out


def shm_batch(seq: int, desc: bytes) -> bytes:
    return packed_map({"v": 2, "t": "shm_batch", "seq": seq}, {"desc": desc})


def test_nested_descriptors_get_a_verdict_and_give_their_credit_back(live):
    """More nested descriptors than the trainer has credits, from two connections: each is
    refused as ``shm_descriptor``, each credit comes back (a peer could not send its next
    one otherwise), and the good producer keeps training."""
    before = live.dropped()
    peers = [Peer(live, "nested-a"), Peer(live, "nested-b")]
    bad = {
        "pool nested": packed_map({"slot": 0, "gen": 1, "seq": 0}, {"pool": nested()}),
        "slot nested": packed_map({"pool": "p1-x", "gen": 1, "seq": 0}, {"slot": nested()}),
        "extra key nested": packed_map(
            {"pool": "p1-x", "slot": 0, "gen": 1, "seq": 0}, {"x": nested()}
        ),
        "pool oversized": msgpack.packb({"pool": "p" * 8000, "slot": 0, "gen": 1, "seq": 0}),
        "seq mistyped": msgpack.packb({"pool": "p1-x", "slot": 0, "gen": 1, "seq": 1.5}),
    }
    sent = 0
    try:
        for round_ in range(2):  # 10 messages in all: more than the 4 credits of the pool
            for name, desc in bad.items():
                peer = peers[sent % 2]
                seq = sent
                if peer.credit == 0:
                    peer._until(lambda m, p=peer: p.credit > 0)
                peer.credit -= 1
                peer.sock.send(shm_batch(seq, desc))
                assert peer.verdict(seq) == "shm_descriptor", (round_, name, peer.details)
                sent += 1
        assert counted(live, before, {"shm_descriptor": sent}) == {"shm_descriptor": sent}
        assert "internal" not in live.dropped()
        live.trains_on()
    finally:
        for peer in peers:
            peer.close()


def _offer_raw(live: Live, data: bytes) -> dict:
    """Say hello, present the welcome's token, then send ``data`` as the pool announce with a
    real sealed pool's fd, over a plain SEQPACKET socket; the trainer's answer."""
    peer = Peer(live, "nested-announce")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock, SlotPool(
            LAYOUT, peer.welcome["shm_slots"]
        ) as pool:
            sock.settimeout(30)
            sock.connect(peer.welcome["shm_socket"])
            sock.send(msgpack.packb({"token": peer.welcome["shm_token"]}))
            assert msgpack.unpackb(sock.recv(4096)) == {"ok": True}
            socket.send_fds(sock, [data], [pool.fd])
            return msgpack.unpackb(sock.recv(4096))
    finally:
        peer.close()


def _announce(**raw: bytes) -> bytes:
    fields = {"v": 1, "pool": "p1-nested", "slots": 2, "layout": LAYOUT.to_wire()}
    for key in raw:
        fields.pop(key, None)
    return packed_map(fields, raw)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"x": nested()}, "header_fields"),
        ({"v": nested()}, "version"),
        ({"pool": nested()}, "header_fields"),
        ({"slots": nested()}, "header_fields"),
        ({"layout": nested()}, "header_fields"),
        ({"layout": msgpack.packb([["pixels", ["<u1"], [4, 65536]], ["tag", "<i8", [4]]])},
         "header_fields"),
        ({"layout": msgpack.packb([["pixels", "|u1", [[4], 65536]], ["tag", "<i8", [4]]])},
         "header_fields"),
        ({"layout": msgpack.packb([["a", "|u1", [1]]] * 3000)}, "header_fields"),
        ({"pool": msgpack.packb("p" * 30000)}, "header_fields"),
    ],
    ids=["extra key nested", "version nested", "pool nested", "slots nested", "layout nested",
         "dtype a list", "dimension a list", "3000 arrays", "pool id of 30000 chars"],
)  # fmt: skip
def test_a_malformed_pool_announce_is_refused_and_the_pools_thread_goes_on(live, raw, reason):
    before = live.dropped()
    answer = _offer_raw(live, _announce(**raw))
    assert answer["ok"] is False and answer["reason"] == reason, answer
    assert len(answer["detail"]) < 400, answer
    assert counted(live, before, {reason: 1}) == {reason: 1}
    assert live.trainer.started.proc.poll() is None, live.trainer.log()[-3000:]
    assert "internal" not in live.dropped()
    live.trains_on()
