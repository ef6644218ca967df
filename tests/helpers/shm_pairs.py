"""What the shared-memory pool tests share: layouts, a release hook that records, the
``pair`` fixture (a producer's ``SlotPool`` and the trainer's ``MappedPool`` of it) and
``publish`` (a committed slot's descriptor)."""

from __future__ import annotations

import os

import numpy as np

from stagefeed.common.shm.layout import (
    SlotLayout,
)
from stagefeed.common.shm.mapped import MappedPool
from stagefeed.common.shm.slots import SlotPool

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


def pairs():
    """The ``pair`` fixture's generator (tests/conftest.py): ``make(layout, slots)`` ->
    (SlotPool, MappedPool, Released); all closed at teardown."""
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
