"""A cluster's input position (docs/resume.md, "Several trainer workers").

Each shard feeds one worker (a producer connects to one trainer with its shard: ``produce
--shard-group``); a worker books the batches its own steps trained, per shard, in its
``ShardBooks``. The cluster's position is the union of every worker's books, shard by shard
(``InputPosition.merge``), and the chief writes it with the model:

- at start, ``share_resume``: the checkpoint the chief resumes from (only its ``--save DIR``
  is read) reaches every worker, so every worker's books start from the same union and every
  worker goes on from the same step; the chief's restored weights follow
  (``shared_state.broadcast_variables``, by the trainer);
- at each checkpoint, ``union_position``: every worker's books gathered on every worker, after
  the model was saved and at the same step (MultiWorkerMirroredStrategy's steps are in
  lockstep, so every worker's books hold the same step's batches).

A checkpoint resumes on ``K`` workers only if it leaves them as many batches
(``consumer.books.redeal.check_even``, at start, on every worker).

A shard that joined two workers would have its batches booked twice, each worker blind to the
other's in-flight batches: ``union_position`` raises ``ConfigError`` naming it (on every
worker, at the same step, since every worker computes the same union).
"""

from __future__ import annotations

import json
from typing import Any

from stagefeed.common.errors import ConfigError
from stagefeed.common.position import InputPosition
from stagefeed.consumer.books.shard_books import ShardBooks
from stagefeed.consumer.cluster.shared_state import broadcast_bytes, gather_bytes
from stagefeed.consumer.cluster.strategy import Cluster
from stagefeed.consumer.resume import Resume


def share_resume(cluster: Cluster, resumed: Resume | None) -> Resume | None:
    """The chief's ``resumed`` (None: a fresh run) on every worker (a collective)."""
    data = b""
    if cluster.chief and resumed is not None:
        data = json.dumps({
            "path": resumed.path, "step": resumed.step, "epoch": resumed.epoch,
            "model_path": resumed.model_path, "position": resumed.position.to_dict(),
        }).encode()  # fmt: skip
    shared = broadcast_bytes(cluster.strategy, cluster.index, cluster.count, data)
    if not shared:
        return None
    got = json.loads(shared)
    where = f"the chief's checkpoint {got['path']}"
    position = InputPosition.from_dict(got["position"], where)
    return Resume(got["path"], got["step"], got["epoch"], got["model_path"], position)


def union_position(cluster: Cluster, books: ShardBooks) -> InputPosition:
    """Every worker's books together (a collective; see the module docstring)."""
    mine: dict[str, Any] = {"position": books.position().to_dict(), "joined": sorted(books.joined)}
    parts = gather_bytes(cluster.strategy, cluster.index, cluster.count, json.dumps(mine).encode())
    union: InputPosition | None = None
    fed_by: dict[int, int] = {}
    for worker, part in enumerate(parts):
        got = json.loads(part)
        for shard in got["joined"]:
            if shard in fed_by:
                raise ConfigError(
                    f"shard {shard} is fed to workers {fed_by[shard]} and {worker}: each shard "
                    "must feed one worker (give each produce its own --shard-group), or its "
                    "batches may be trained twice"
                )
            fed_by[shard] = worker
        if got["position"]["shards"] == 0:  # nothing booked there yet
            continue
        position = InputPosition.from_dict(got["position"], f"worker {worker}'s books")
        union = position if union is None else union.merge(position)
    return union if union is not None else books.position()
