"""The producer's shared-memory slot pool in one process (real memfds): the slot layout and
its wire form, acquire/commit/release, the sealed memfd, the sizing rule, and the imports.

The trainer's read-only mapping of a pool: test_shm_mapped.py. Cross-process behaviour (kill -9,
truncation, fd passing between processes, the canary): test_shm_faults.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest

from stagefeed.common.errors import ClosedError, ConfigError, ProtocolError
from stagefeed.common.shm.layout import (
    F_GET_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    PoolAnnounce,
    SlotLayout,
)
from stagefeed.common.shm.mapped import Descriptor
from stagefeed.common.shm.sizing import slots_needed, slots_per_pool
from stagefeed.common.shm.slots import SlotPool
from tests.helpers.shm_pairs import ODD, SMALL, publish


def test_layout_offsets_and_every_view_are_64_byte_aligned(pair):
    assert all(off % 64 == 0 for off in ODD.offsets) and ODD.stride % 64 == 0
    pool, mapped, _ = pair(ODD, slots=5)
    for seq in range(5):
        slot = pool.acquire(timeout=1)
        writable = pool.arrays(slot)
        assert [a.ctypes.data % 64 for a in writable.values()] == [0] * 5
        views = mapped.view(Descriptor.parse(pool.commit(slot, seq)))
        assert [v.ctypes.data % 64 for v in views.values()] == [0] * 5
        assert [v.shape for v in views.values()] == [a.shape for a in ODD.arrays]
        assert all(v.flags.c_contiguous and not v.flags.writeable for v in views.values())


@pytest.mark.parametrize(
    "arrays",
    [
        [],
        [("x", object, (2,))],
        [("x", np.dtype([("a", "<i4")]), (2,))],
        [("x", ">f4", (2,))],
        [("x", np.float32, (0,))],
        [("x", np.float32, (-1,))],
        [("bad name", np.float32, (2,))],
        [("x", np.float32, (2,)), ("x", np.int32, (2,))],
        [("x", np.float32, (2,) * 10)],  # the schema allows 8 per example, plus the batch
        [("x", "not-a-dtype", (2,))],
    ],
)
def test_layout_refuses_bad_arrays(arrays):
    with pytest.raises(ConfigError):
        SlotLayout.of(arrays)


@pytest.mark.parametrize(
    "announce",
    [
        None,
        [],
        {"v": 1, "pool": "p", "slots": 2},
        {"v": 2, "pool": "p", "slots": 2, "layout": [["x", "|u1", [4]]]},
        {"v": 1, "pool": "p/../x", "slots": 2, "layout": [["x", "|u1", [4]]]},
        {"v": 1, "pool": "p", "slots": 0, "layout": [["x", "|u1", [4]]]},
        {"v": 1, "pool": "p", "slots": True, "layout": [["x", "|u1", [4]]]},
        {"v": 1, "pool": "p", "slots": 2, "layout": [["x", "|O", [4]]]},
        {"v": 1, "pool": "p", "slots": 2, "layout": [["x", "|u1", 4]]},
        {"v": 1, "pool": "p", "slots": 2, "layout": [["x", "|u1", [2**40]]]},
        {"v": 1, "pool": "p", "slots": 4096, "layout": [["x", "|u1", [2**31 - 1]] * 1]},
        {"v": 1, "pool": "p", "slots": 2, "layout": "x"},
        {"v": 1, "pool": "p", "slots": 2, "layout": [["x", "|u1", [4], "extra"]]},
    ],
)
def test_announce_from_wire_refuses_hostile_input_with_protocol_errors_only(announce):
    with pytest.raises(ProtocolError):
        PoolAnnounce.from_wire(announce)


def test_announce_and_descriptor_survive_msgpack(pair):
    pool, _, _ = pair(ODD)
    wire = msgpack.unpackb(msgpack.packb(pool.announce()))
    assert PoolAnnounce.from_wire(wire) == pool.announcement
    desc = publish(pool, seq=3)
    assert msgpack.unpackb(msgpack.packb(desc)) == desc
    assert set(desc) == {"pool", "slot", "gen", "seq"}


def test_acquire_times_out_stops_wakes_and_closes():
    pool = SlotPool(SMALL, 2)
    descs = [publish(pool, seq) for seq in range(2)]
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.1)
    results: list[object] = []

    def waiter(**kwargs) -> threading.Thread:
        def run() -> None:
            try:
                results.append(pool.acquire(**kwargs))
            except (ClosedError, TimeoutError) as exc:
                results.append(type(exc))

        thread = threading.Thread(target=run, name="shm-test-acquire", daemon=True)
        thread.start()
        return thread

    stop = threading.Event()
    thread = waiter(stop=stop)
    stop.set()
    thread.join(5)
    assert results == [ClosedError]
    thread = waiter(timeout=5)
    assert pool.release(descs[1]["slot"], descs[1]["gen"])
    thread.join(5)
    assert results[-1] == descs[1]["slot"]
    thread = waiter()
    pool.close()
    thread.join(5)
    assert not thread.is_alive() and results[-1] is ClosedError
    pool.close()
    with pytest.raises(ClosedError):
        pool.acquire(timeout=0)


def test_release_ignores_stale_duplicate_and_unknown_slots():
    with SlotPool(SMALL, 2) as pool:
        desc = publish(pool, seq=1)
        assert pool.release(desc["slot"], desc["gen"] + 1) is False
        assert pool.release(5, 1) is False and pool.release(-1, 1) is False
        assert pool.release(desc["slot"], desc["gen"]) is True
        assert pool.release(desc["slot"], desc["gen"]) is False  # duplicate
        writing = pool.acquire(timeout=1)
        assert pool.release(writing, 2) is False  # not committed yet
        pool.discard(writing)
        assert pool.free_slots() == 2
        with pytest.raises(ValueError):
            pool.commit(writing, 1)  # discarded: no longer WRITING


def test_pool_fd_is_a_sealed_memfd_that_refuses_resizing():
    with SlotPool(SMALL, 2) as pool:
        assert os.readlink(f"/proc/self/fd/{pool.fd}").startswith("/memfd:stagefeed-")
        seals = __import__("fcntl").fcntl(pool.fd, F_GET_SEALS)
        assert seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 7
        for size in (0, pool.size + 4096):
            with pytest.raises(OSError) as caught:
                os.ftruncate(pool.fd, size)
            assert caught.value.errno == errno.EPERM
        assert os.fstat(pool.fd).st_size == pool.size


def test_sizing_rule():
    assert slots_needed(queue_capacity=8, stage_depth=2, in_flight=1, producers=3) == 14
    assert slots_per_pool(14, 3) == 5  # ceil(11 / 3) + 1: each pool can hold its share + 1
    assert slots_per_pool(14, 1) == 14
    for bad in [(-1, 0, 0, 1), (1, 0, 0, 0), (1.5, 0, 0, 1), (True, 0, 0, 1)]:
        with pytest.raises(ConfigError):
            slots_needed(*bad)
    with pytest.raises(ConfigError):
        slots_per_pool(2, 3)


def test_bench_shm_copy_runs_and_prints_every_row(capsys):
    from stagefeed.bench import shm_copy

    assert shm_copy.main(["--batch-size", "1", "--windows", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("| ") >= 6 and "validate + map" in out and "x memcpy" in out


def test_shm_modules_import_neither_tensorflow_nor_zmq():
    code = (
        "import sys; import stagefeed.common.shm.slots, stagefeed.common.shm.mapped, "
        "stagefeed.common.shm.fd_passing; "
        "print(sorted(m for m in ('tensorflow', 'zmq') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
