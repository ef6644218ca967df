"""What a producer's main loop sends through: the ``Channel`` protocol.

Two classes keep it: ``TrainerChannel`` (``producer.channel``: one trainer) and ``Fanout``
(``producer.fanout``: a ``TrainerChannel`` to each of several trainers, every batch to exactly
one). ``producer.fanout.make_channel`` picks one; ``send_loop``, ``shm_send`` and ``worker``
see only this. A pass's end and the wait for ``saved`` are a single trainer's
(``TrainerChannel.end_pass``, ``wait_saved``): a source with passes feeds one trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from stagefeed.common.shm.slots import SlotPool
from stagefeed.producer.channel import OnRelease
from stagefeed.producer.handoff import Drained, Welcome
from stagefeed.producer.shm_lane import ShmLane


class Channel(Protocol):
    """The calls of the producer's main loop, in its order: ``open`` (until a welcome), then
    ``send`` a batch (or ``acquire_slot``, fill it, ``commit_slot``, ``send_descriptor``;
    ``discard_slot`` if it is not sent), then ``finish`` (``end``) and ``close``. The counters
    (``held``, ``waiting``, ``in_zeromq``, ``refused``, ``trainers``) are for its log lines."""

    @property
    def endpoint(self) -> str:
        """The trainer's endpoint (a fan-out: all of them, comma-separated)."""
        ...

    @property
    def welcome(self) -> Welcome | None:
        """The welcome that settled the schema; None before ``open`` returns."""
        ...

    @property
    def repositioned(self) -> tuple[int, list[list[int]]] | None:
        """Where a later welcome moved this shard (the loop rewinds there); else None."""
        ...

    @property
    def lane(self) -> ShmLane | None:
        """Not None when batches may go through shared-memory slots."""
        ...

    def open(self, stop: Any) -> Welcome: ...

    def send(
        self, arrays: Mapping[str, np.ndarray], seq: int, stop: Any, on_release: OnRelease = None
    ) -> None: ...

    def acquire_slot(self, stop: Any) -> tuple[SlotPool, int] | None: ...

    def commit_slot(self, pool: SlotPool, slot: int, seq: int) -> dict[str, Any] | None: ...

    def send_descriptor(self, desc: dict[str, Any], seq: int, stop: Any) -> None: ...

    def discard_slot(self, pool: SlotPool, slot: int) -> None: ...

    def held(self) -> int: ...

    def waiting(self) -> int: ...

    def in_zeromq(self) -> int: ...

    def refused(self) -> dict[str, int]: ...

    def trainers(self) -> dict[str, dict[str, int]]: ...

    def finish(
        self, count: int, stop: Any, timeout_s: float, reason: str = "ok", detail: str = "",
        bad: tuple[int, str] = (0, ""),
    ) -> Drained: ...

    def close(self, linger_s: float = 0.0) -> None: ...
