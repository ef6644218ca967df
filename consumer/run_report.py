"""What a run did, frozen at its end: the ``RunReport`` a trainer builds (``TrainerBase.report``)
and the summary reads (``consumer.observe.summary``), never the trainer itself.

Built once the trainer is closed, so its books (the ledger's totals and per-producer figures)
are final; a cluster worker's adds its place and every worker's books (``ClusterReport``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from stagefeed.common.options import TrainerOptions
from stagefeed.consumer.books.books import Totals


@dataclasses.dataclass(frozen=True)
class ClusterReport:
    """One worker of a ``TF_CONFIG`` cluster: its place, and every worker's books (summed
    over the cluster at the end; None when the run ended before they were gathered)."""

    worker: int
    workers: int
    chief: bool
    books: Mapping[str, int] | None


@dataclasses.dataclass(frozen=True)
class RunReport:
    """A trainer's run, as the summary shows it (see the module docstring)."""

    options: TrainerOptions
    device: str
    endpoint: str
    transport: str  # tcp, ipc, shm+tcp, shm+ipc
    shm: Mapping[str, Any] | None  # the shared-memory gate's figures; None without it
    steps_done: int  # the last step's number (a resumed run's go on from its checkpoint's)
    steps_planned: int  # 0: as long as the data or the passes say
    passes_trained: int | None  # None: no source with passes joined
    resumed_from: int | None
    loss_first: float | None
    loss_last: float | None
    loss_finite: bool
    metrics: Mapping[str, float]  # the model's own, after the last step (Keras)
    data_ended: bool
    drained_because: str | None
    totals: Totals
    drops_by_reason: Mapping[str, int]
    refusals: Mapping[str, Mapping[str, int]]
    producers_ended: Mapping[str, int]
    producers_left: tuple[Mapping[str, Any], ...]
    connections: Mapping[str, int]
    producers: Mapping[str, Mapping[str, Any]]
    producer_count: int  # every producer the trainer saw
    # Records the producers' sources skipped (--on-bad-record skip), the first ones named.
    bad_records: tuple[int, tuple[str, ...]] = (0, ())
    cluster: ClusterReport | None = None
