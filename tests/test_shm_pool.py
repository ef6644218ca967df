"""Shared-memory slot pool and its read-only mapping, in one process (real memfds, real mmaps).

Cross-process behaviour (kill -9, truncation, fd passing between processes, the canary) is in
test_shm_faults.py.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest
from stagefeed.common.errors import ClosedError, ConfigError, DropReason, ProtocolError
from stagefeed.common.shm.layout import (
    F_ADD_SEALS,
    F_GET_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    PoolAnnounce,
    SlotLayout,
)
from stagefeed.common.shm.mapped import Descriptor, MappedPool, PoolTable
from stagefeed.common.shm.sizing import slots_needed, slots_per_pool
from stagefeed.common.shm.slots import SlotPool, reserve

# Odd sizes on purpose: no array's size is a multiple of 64.
ODD = SlotLayout.of(
    [
        ("images", np.float32, (2, 5, 7, 3)),
        ("mask", np.bool_, (3,)),
        ("ids", np.int64, (5,)),
        ("labels", np.int32, (2,)),
        ("pixels", np.uint8, (3, 11)),
    ]  # fmt: skip
)
SMALL = SlotLayout.of([("x", np.uint8, (1000,)), ("y", np.int64, (3,))])
OWNER = b"connection-1"  # a PoolTable owner: a ZeroMQ routing id in the trainer


class Released:
    """A release hook that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, pool_id: str, slot: int, gen: int) -> None:
        self.calls.append((pool_id, slot, gen))


@pytest.fixture
def pair():
    """``make(layout, slots)`` -> (SlotPool, MappedPool, Released); all closed at teardown."""
    made = []

    def make(layout: SlotLayout = SMALL, slots: int = 3):
        pool = SlotPool(layout, slots)
        hook = Released()
        mapped = MappedPool(os.dup(pool.fd), pool.announcement, hook)
        made.append((pool, mapped))
        return pool, mapped, hook

    yield make
    for pool, mapped in made:
        mapped.close()
        pool.close()


def publish(pool: SlotPool, seq: int, value: int = 7) -> dict:
    slot = pool.acquire(timeout=1)
    for array in pool.arrays(slot).values():
        array[...] = value
    return pool.commit(slot, seq)


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


def test_commit_then_view_round_trip_is_read_only(pair):
    pool, mapped, _ = pair()
    slot = pool.acquire(timeout=1)
    arrays = pool.arrays(slot)
    arrays["x"][:] = np.arange(1000) % 251
    arrays["y"][:] = [-1, 2**40, 3]
    views = mapped.view(Descriptor.parse(pool.commit(slot, seq=11)))
    assert np.array_equal(views["x"], np.arange(1000) % 251)
    assert views["y"].tolist() == [-1, 2**40, 3]
    with pytest.raises(ValueError, match="read-only"):
        views["x"][0] = 1
    arrays["x"][0] = 99  # same memory: the producer's write is visible (trusted producers only)
    assert views["x"][0] == 99


def test_each_bad_descriptor_is_refused_with_its_reason(pair):
    pool, mapped, _ = pair(slots=2)
    table = PoolTable()
    table.add(mapped, OWNER)
    good = publish(pool, seq=1)
    writing = pool.acquire(timeout=1)  # acquired, never committed
    torn = {"pool": pool.pool_id, "slot": writing, "gen": 1, "seq": 2}
    cases = {
        DropReason.SHM_POOL: dict(good, pool="forged-pool"),
        DropReason.SHM_SLOT: dict(good, slot=2),
        DropReason.SHM_GENERATION: dict(good, gen=good["gen"] + 1),
        DropReason.SHM_UNCOMMITTED: torn,
        DropReason.SHM_SEQUENCE: dict(good, seq=2),
    }
    for reason, desc in cases.items():
        for refuser in (mapped.view, lambda d: table.view(d, OWNER)):
            with pytest.raises(ProtocolError) as caught:
                refuser(Descriptor.parse(desc))
            assert caught.value.reason is reason, desc
    views = table.view(Descriptor.parse(good), OWNER)
    with pytest.raises(ProtocolError) as caught:
        mapped.view(Descriptor.parse(good))  # replayed while the first copy is alive
    assert caught.value.reason is DropReason.SHM_REPLAY
    del views
    assert pool.release(good["slot"], good["gen"])
    with pytest.raises(ProtocolError) as caught:
        mapped.view(Descriptor.parse(good))  # replayed after release, before the slot is rewritten
    assert caught.value.reason is DropReason.SHM_REPLAY
    pool.discard(writing)
    while (slot := pool.acquire(timeout=1)) != good["slot"]:
        pool.discard(slot)
    pool.commit(slot, seq=3)
    with pytest.raises(ProtocolError) as caught:
        mapped.view(Descriptor.parse(good))  # the slot was rewritten: stale generation
    assert caught.value.reason is DropReason.SHM_GENERATION
    table.close()


def test_malformed_descriptors_raise_only_protocol_errors(pair):
    pool, mapped, _ = pair()
    good = publish(pool, seq=1)
    junk = [None, 1, "x", [], [good], {}, dict(good, extra=1), {k: good[k] for k in list(good)[:3]}]
    for key in ("pool", "slot", "gen", "seq"):
        for value in (None, True, -1, 2**64, 1.0, "1", b"1", [1], {"a": 1}, "p" * 65, ""):
            junk.append(dict(good, **{key: value}))
    rng = np.random.default_rng(0)
    for _ in range(500):
        junk.append({k: int(rng.integers(-(2**62), 2**62)) for k in ("slot", "gen", "seq")})
        junk[-1]["pool"] = pool.pool_id
    for desc in junk:
        with pytest.raises(ProtocolError):
            mapped.view(Descriptor.parse(desc))
    assert mapped.outstanding() == {}
    assert mapped.view(Descriptor.parse(good))  # refusals did not disturb the valid descriptor


def test_release_fires_once_when_the_last_view_of_a_slot_dies(pair):
    pool, mapped, hook = pair()
    desc = publish(pool, seq=5)
    views = mapped.view(Descriptor.parse(desc))
    x, y = views["x"], views["y"]
    derived = x[10:20]  # a slice keeps its base (the fed view) alive
    del views, x
    gc.collect()
    assert hook.calls == []
    del y
    assert hook.calls == []
    assert mapped.outstanding() == {desc["slot"]: desc["gen"]}
    del derived
    assert hook.calls == [(pool.pool_id, desc["slot"], desc["gen"])]
    gc.collect()
    assert len(hook.calls) == 1 and mapped.outstanding() == {}


def test_release_arriving_after_close_is_tolerated_and_mapping_stays_readable(pair):
    pool, mapped, hook = pair()
    desc = publish(pool, seq=1, value=42)
    views = mapped.view(Descriptor.parse(desc))
    mapped.close()
    mapped.close()
    pool.close()
    assert int(views["x"].sum()) == 42 * 1000  # still mapped while a view lives
    with pytest.raises(ProtocolError) as caught:
        mapped.view(Descriptor.parse(dict(desc, gen=desc["gen"])))
    assert caught.value.reason is DropReason.SHM_POOL
    del views
    assert hook.calls == [(pool.pool_id, desc["slot"], desc["gen"])]
    assert pool.release(desc["slot"], desc["gen"]) is False  # late release to a closed pool


def test_release_hook_errors_are_logged_not_raised(caplog):
    pool = SlotPool(SMALL, 1)

    def broken(pool_id: str, slot: int, gen: int) -> None:
        raise RuntimeError("back channel gone")

    mapped = MappedPool(os.dup(pool.fd), pool.announcement, broken)
    views = mapped.view(Descriptor.parse(publish(pool, seq=1)))
    with caplog.at_level(logging.ERROR):
        del views
    assert "release hook failed" in caplog.text
    mapped.close()
    pool.close()


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


def _memfd(size: int, seals: int | None) -> int:
    import fcntl

    fd = os.memfd_create("test-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    reserve(fd, size)
    if seals is not None:
        fcntl.fcntl(fd, F_ADD_SEALS, seals)
    return fd


@pytest.mark.parametrize(
    ("seals", "slots", "reason"),
    [
        (None, 2, DropReason.SHM_SEALS),
        (F_SEAL_SHRINK, 2, DropReason.SHM_SEALS),
        (F_SEAL_GROW | F_SEAL_SEAL, 2, DropReason.SHM_SEALS),
        (F_SEAL_SHRINK | F_SEAL_GROW, 3, DropReason.SHM_POOL_SIZE),  # announce lies about size
    ],
)
def test_mapped_pool_refuses_fds_without_seals_or_of_the_wrong_size(seals, slots, reason):
    fd = _memfd(2 * SMALL.stride, seals)
    with pytest.raises(ProtocolError) as caught:
        MappedPool(fd, PoolAnnounce("p1", slots, SMALL), Released())
    assert caught.value.reason is reason
    with pytest.raises(OSError):
        os.fstat(fd)  # refused or not, the fd was taken over and closed


def test_mapped_pool_refuses_a_regular_file(tmp_path):
    with open(tmp_path / "pool", "wb") as f:
        f.truncate(2 * SMALL.stride)
    fd = os.open(tmp_path / "pool", os.O_RDONLY)
    with pytest.raises(ProtocolError) as caught:
        MappedPool(fd, PoolAnnounce("p1", 2, SMALL), Released())
    assert caught.value.reason is DropReason.SHM_SEALS


def test_pool_table_refuses_duplicates_and_routes_by_pool_id(pair):
    (pool_a, mapped_a, _), (pool_b, mapped_b, _) = pair(), pair()
    table = PoolTable(max_pools=2)
    table.add(mapped_a, "a")
    table.add(mapped_b, "b")
    third = MappedPool(os.dup(pool_a.fd), pool_a.announcement, Released())
    with pytest.raises(ProtocolError):
        table.add(third, "c")
    assert third.closed and table.ids() == sorted([pool_a.pool_id, pool_b.pool_id])
    assert int(table.view(Descriptor.parse(publish(pool_b, seq=1, value=3)), "b")["x"][0]) == 3
    table.remove(pool_b.pool_id)
    assert mapped_b.closed
    with pytest.raises(ProtocolError) as caught:
        table.view(Descriptor.parse(publish(pool_b, seq=2)), "b")
    assert caught.value.reason is DropReason.SHM_POOL
    table.close()
    table.close()


def test_pool_table_is_the_one_owner_table(pair):
    (pool_a, mapped_a, _), (pool_b, mapped_b, _) = pair(), pair()
    table = PoolTable()
    assert table.add(mapped_a, OWNER) is None
    assert table.owner(pool_a.pool_id) == OWNER and table.pool_of(OWNER) == pool_a.pool_id
    with pytest.raises(ProtocolError) as caught:
        table.view(Descriptor.parse(publish(pool_a, seq=1)), b"someone-else")
    assert caught.value.reason is DropReason.SHM_POOL and "another connection" in str(caught.value)
    with pytest.raises(ProtocolError):
        table.admit(pool_a.pool_id)  # a duplicate id is refused before anything is mapped
    assert table.add(mapped_b, OWNER) == pool_a.pool_id  # a newer pool retires the older
    assert mapped_a.closed and table.ids() == [pool_b.pool_id]
    assert table.pool_of(OWNER) == pool_b.pool_id and table.owner(pool_a.pool_id) is None
    assert table.remove(pool_b.pool_id, b"someone-else") is False and not mapped_b.closed
    assert table.remove(pool_b.pool_id, OWNER) is True and mapped_b.closed
    assert table.pool_of(OWNER) is None and table.ids() == []
    table.close()


def test_sizing_rule():
    assert slots_needed(queue_capacity=8, stage_depth=2, in_flight=1, producers=3) == 14
    assert slots_per_pool(14, 3) == 5  # ceil(11 / 3) + 1: each pool can hold its share + 1
    assert slots_per_pool(14, 1) == 14
    for bad in [(-1, 0, 0, 1), (1, 0, 0, 0), (1.5, 0, 0, 1), (True, 0, 0, 1)]:
        with pytest.raises(ConfigError):
            slots_needed(*bad)
    with pytest.raises(ConfigError):
        slots_per_pool(2, 3)


def test_closing_either_side_never_unmaps_memory_a_view_still_uses(pair, caplog):
    pool, mapped, hook = pair()
    slot = pool.acquire(timeout=1)
    writable = pool.arrays(slot)["x"]
    pool.arrays(slot)["y"][:] = 9
    desc = pool.commit(slot, seq=1)
    reshaped = (
        mapped.view(Descriptor.parse(desc))["y"].reshape(-1)[::2].T
    )  # only a derived view survives
    with caplog.at_level(logging.WARNING):
        pool.close()
    assert "still referenced" in caplog.text
    mapped.close()
    writable[0] = 5  # would segfault had close() unmapped it
    assert reshaped.tolist() == [9, 9] and hook.calls == []
    del reshaped
    assert len(hook.calls) == 1


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


def _mapped_rss_kib(pool_id: str) -> list[int]:
    """Rss (KiB) of each of this process's mappings of pool ``pool_id``'s memfd."""
    rss, inside = [], False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and ":" not in first:  # a mapping's header line: range perms ...
                inside = f"stagefeed-{pool_id}" in line
            elif inside and first == "Rss:":
                rss.append(int(line.split()[1]))
    return rss


def test_both_mappings_are_resident_from_the_start(pair):
    """MAP_POPULATE on both sides: no slot's first write or read takes a page fault per page."""
    layout = SlotLayout.of([("x", np.uint8, (4 << 20,))])
    pool, mapped, _ = pair(layout, 3)
    rss = _mapped_rss_kib(pool.pool_id)
    assert len(rss) == 2, rss  # the producer's read-write and the trainer's read-only mapping
    assert all(kib * 1024 >= pool.size for kib in rss), (rss, pool.size)
