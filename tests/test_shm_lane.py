"""The producer's lane and the trainer's gate together, in one process (no TensorFlow, no
ZeroMQ): a pool per welcome, retirement, releases routed by connection, ``auto`` fallbacks,
and the start-time check that a pool fits in memory.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest

from stagefeed.common.errors import BrokenError, ClosedError, ConfigError, DropReason, ProtocolError
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.common.shm.sizing import pool_slots
from stagefeed.consumer.books.ledger import Ledger
from stagefeed.consumer.intake.shm_config import default_socket_path
from stagefeed.consumer.intake.shm_gate import ShmGate
from stagefeed.producer.shm_lane import ShmLane, ShmOffer
from tests.conftest import wait_for

SCHEMA = Schema((ArraySpec("x", "float32", (16,)), ArraySpec("y", "int64")), batch_size=4)
RID, OTHER = b"connection-1", b"connection-2"


@pytest.fixture
def gate(tmp_path):
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=SCHEMA, queue_mb=0.001, transport="shm",
        shm_socket=str(tmp_path / "sock" / "pools.sock"),
    )  # fmt: skip
    ledger = Ledger()
    opened = ShmGate.open(options, SCHEMA, ledger)
    assert opened is not None
    failures: list[BaseException] = []
    opened.start(failures.append)
    opened.ledger = ledger
    yield opened
    opened.close()
    assert not failures


def offer_of(gate: ShmGate, rid: bytes = RID) -> ShmOffer:
    fields = gate.offer(rid, 0)
    return ShmOffer(fields["shm_socket"], fields["shm_token"], fields["shm_slots"])


def shm_batch(desc: dict) -> dict:
    return {"seq": desc["seq"], "desc": desc}


def test_sizing_follows_the_queue_budget(gate):
    capacity = max(1, int(0.001 * 2**20) // SCHEMA.batch_bytes)  # 3 batches of 288 B
    assert gate.sizing.slots == pool_slots(capacity, 2, 2, 1) == capacity + 2 + 1 + 2 + 1
    assert pool_slots(100, 2, 2, 4) == 25 + 1 + 2 + 1  # ceil(103 / 4) + credit + one filling
    assert pool_slots(1, 16, 1, 64) == 18  # never fewer than stage_depth + 2
    assert pool_slots(10**6, 1, 1, 1) == 4096


def test_a_pool_per_welcome_releases_routed_back_and_the_old_pool_retired(gate, caplog):
    caplog.set_level(logging.INFO, logger="stagefeed.consumer.intake.shm_gate")
    lane = ShmLane("shm", "tcp://trainer:1")
    try:
        lane.on_welcome(offer_of(gate), SCHEMA)
        assert lane.mode == "shm" and gate.stats()["pools_accepted"] == 1
        first = lane.pool_id
        pool, slot = lane.acquire(1.0)
        pool.arrays(slot)["x"][...] = 7
        desc = lane.commit(pool, slot, 0)
        with pytest.raises(ProtocolError) as caught:  # named on another connection
            gate.batch(OTHER, shm_batch(desc))
        assert caught.value.reason is DropReason.SHM_POOL
        batch = gate.batch(RID, shm_batch(desc))
        assert np.all(batch.arrays["x"] == 7) and not batch.arrays["x"].flags.writeable
        assert batch.arrays["x"].ctypes.data % 64 == 0
        assert gate.releases() == []  # the view is alive: nothing to send
        del batch
        gc.collect()
        ((rid, pool_id, got_slot, gen),) = gate.releases()
        assert (rid, pool_id, got_slot, gen) == (RID, first, slot, desc["gen"])
        assert lane.release(pool_id, got_slot, gen) and not lane.release(pool_id, got_slot, gen)
        # A second welcome (the trainer forgot us, or was restarted): a new pool, while a
        # slot of the old one is being written; that batch is lost, never sent.
        pool, slot = lane.acquire(1.0)
        lane.on_welcome(offer_of(gate), SCHEMA)
        assert lane.pool_id != first and lane.mode == "shm"
        assert lane.commit(pool, slot, 1) is None
        with pytest.raises(ClosedError):  # closed once that slot was given up
            pool.acquire(timeout=0.1)
        assert wait_for(lambda: gate.stats()["pools_live"] == 1, 10)
        assert not lane.release(first, slot, 1)  # a release for the retired pool is ignored
    finally:
        lane.close()
    # EOF: the pool stays readable while its connection may still deliver a descriptor sent
    # before it (ZeroMQ and the fd channel race); its end lets the pool go.
    assert wait_for(lambda: "readable until its connection ends" in caplog.text, 10)
    assert gate.stats()["pools_live"] == 1
    gate.ended(RID)
    assert wait_for(lambda: gate.stats()["pools_live"] == 0, 10)


def test_a_token_is_good_once_and_only_for_a_live_connection(gate):
    offer = offer_of(gate)
    lanes = [ShmLane("shm", "tcp://trainer:1") for _ in range(3)]
    try:
        lanes[0].on_welcome(offer, SCHEMA)
        with pytest.raises(BrokenError, match="shm_token"):
            lanes[1].on_welcome(offer, SCHEMA)  # reused
        forgotten = offer_of(gate, OTHER)
        gate.forget(OTHER)
        with pytest.raises(BrokenError, match="shm_token"):
            lanes[2].on_welcome(forgotten, SCHEMA)
        assert wait_for(lambda: gate.ledger.drops_by_reason().get("shm_token") == 2, 10)
    finally:
        for lane in lanes:
            lane.close()


def test_auto_falls_back_and_shm_fails_with_the_reason(gate, tmp_path):
    nowhere = ShmOffer(str(tmp_path / "nowhere" / "pools.sock"), "00" * 16, 4)
    cases = [(None, ConfigError, "offers no shared memory"), (nowhere, BrokenError, "same host")]
    for offer, error, text in cases:
        strict, auto = ShmLane("shm", "tcp://trainer:1"), ShmLane("auto", "tcp://trainer:1")
        with pytest.raises(error, match=text):
            strict.on_welcome(offer, SCHEMA)
        auto.on_welcome(offer, SCHEMA)
        assert auto.mode == "zmq" and auto.acquire(0.1) is None
        strict.close()
        auto.close()


def test_a_pool_larger_than_free_memory_is_refused_before_reserving_anything(gate):
    huge = Schema((ArraySpec("x", "uint8", (2**26,)),), batch_size=1)  # 64 MiB a slot
    offer = ShmOffer(gate.path, "00" * 16, 4096)  # 256 GiB
    lane = ShmLane("shm", "tcp://trainer:1")
    with pytest.raises(ConfigError) as caught:
        lane.on_welcome(offer, huge)
    message = str(caught.value)
    assert "needs 262144.2 MiB (4096 slots)" in message and "MiB is free" in message
    assert "--queue-mb" in message and "--transport zmq" in message
    auto = ShmLane("auto", "tcp://trainer:1")
    auto.on_welcome(offer, huge)
    assert auto.mode == "zmq"


def test_default_socket_path_is_private_stable_and_short():
    path = default_socket_path("tcp://*:5555")
    assert path == default_socket_path("tcp://*:5555") != default_socket_path("tcp://*:5556")
    assert path.endswith("/pools-5555.sock") and len(path.encode()) <= 107
    assert len(default_socket_path("ipc:///" + "x" * 300).encode()) <= 107


def test_a_pool_is_known_to_the_gate_before_its_producer_hears_ok(gate):
    """The producer may send a descriptor the moment ``offer_pool`` returns: the gate must
    route it then, not once its pools thread gets round to it (bench ingest hit this race)."""
    lane = ShmLane("shm", "tcp://trainer:1")
    try:
        for seq in range(20):
            lane.on_welcome(offer_of(gate), SCHEMA)  # a new pool each time, as on re-welcome
            pool, slot = lane.acquire(1.0)
            batch = gate.batch(RID, shm_batch(lane.commit(pool, slot, seq)))
            del batch
    finally:
        lane.close()
