"""How big each producer's shared-memory pool is: the one sizing rule (docs/shm.md "Sizing").

Both sides use it: the trainer grants ``pool_slots`` in its welcome and reports ``PoolSizing``;
producers never ask for more than they were granted.
"""

from __future__ import annotations

import dataclasses
import math

from stagefeed.common.errors import ConfigError
from stagefeed.common.shm.layout import MAX_SLOTS, MIB


def slots_needed(queue_capacity: int, stage_depth: int, in_flight: int, producers: int) -> int:
    """Slots across all pools: every queued, staged and in-flight batch holds one, and each
    producer needs one more to fill while the others wait (shm.md "Sizing")."""
    for name, value, low in [
        ("queue_capacity", queue_capacity, 0),
        ("stage_depth", stage_depth, 0),
        ("in_flight", in_flight, 0),
        ("producers", producers, 1),
    ]:
        if type(value) is not int or value < low:
            raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return queue_capacity + stage_depth + in_flight + producers


def slots_per_pool(total: int, producers: int) -> int:
    """Slots for each producer's own pool when ``total`` (from ``slots_needed``) is shared."""
    if type(total) is not int or type(producers) is not int or not 1 <= producers <= total:
        raise ConfigError(f"need 1 <= producers ({producers!r}) <= total slots ({total!r})")
    return math.ceil((total - producers) / producers) + 1


def pool_slots(queue_capacity: int, stage_depth: int, credit: int, producers: int) -> int:
    """Slots of each producer's pool for a trainer of this queue, staging depth and credit,
    sized for ``producers`` same-host producers (docs/shm.md "Sizing").

    Across the pools: every queued and staged batch, the one a step trains on, each
    producer's credit in flight (committed, not yet enqueued) and one slot per producer to
    fill. Never fewer than ``stage_depth + 2``, so one producer alone always makes progress
    (the train loop waits for one queued batch beyond the staged ones before a step).
    """
    total = slots_needed(queue_capacity, stage_depth + 1, credit * producers, producers)
    return min(MAX_SLOTS, max(stage_depth + 2, slots_per_pool(total, producers)))


@dataclasses.dataclass(frozen=True)
class PoolSizing:
    """What each producer's pool holds (``pool_slots``), for logs and the summary."""

    slots: int
    stride: int
    producers: int

    @classmethod
    def for_trainer(
        cls, queue_capacity: int, stage_depth: int, credit: int, producers: int, stride: int
    ) -> PoolSizing:
        """The pools of a trainer with this queue, staging depth and credit, for
        ``producers`` same-host producers of slots ``stride`` bytes apart."""
        slots = pool_slots(queue_capacity, stage_depth, credit, producers)
        return cls(slots, stride, producers)

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.stride

    def describe(self) -> str:
        return (
            f"{self.slots} slots of {self.stride / MIB:.2f} MiB = {self.pool_bytes / MIB:.1f} MiB "
            f"per producer, {self.producers * self.pool_bytes / MIB:.1f} MiB for the "
            f"{self.producers} producer(s) it is sized for"
        )
