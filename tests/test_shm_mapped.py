"""The trainer's read-only mapping of a producer's pool, in one process (real memfds, real
mmaps): descriptors checked once (``Descriptor.parse``), each bad one refused with its reason,
releases fired once when the last view dies, ``PoolTable`` as the one owner table, and memory
never unmapped under a live view.
"""

from __future__ import annotations

import gc
import logging
import os

import numpy as np
import pytest

from stagefeed.common.errors import DropReason, ProtocolError
from stagefeed.common.shm.layout import (
    F_ADD_SEALS,
    F_SEAL_GROW,
    F_SEAL_SEAL,
    F_SEAL_SHRINK,
    PoolAnnounce,
    SlotLayout,
)
from stagefeed.common.shm.mapped import Descriptor, MappedPool, PoolTable
from stagefeed.common.shm.slots import SlotPool, reserve
from tests.helpers.shm_pairs import OWNER, SMALL, Released, publish


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
