"""State that one worker of the cluster holds and every worker needs: moved by all-reduces.

Every worker calls each of these at the same point of its run (each is a collective: a worker
that skips it leaves the others waiting). Resume (docs/resume.md, "Several trainer workers")
needs three moves:

- ``broadcast_bytes``: the chief's bytes (the checkpoint it resumes from, as JSON) to every
  worker; the others pass None;
- ``broadcast_variables``: the chief's values of the model's and the optimizer's variables to
  every worker (only the chief's ``--save DIR`` holds the checkpoint, and a restore after the
  variables were made is not mirrored by the strategy);
- ``gather_bytes``: every worker's bytes (its books of the input position) to every worker.

and the end of a run one sum (``sum_over_workers``: the cluster's books in every summary).

Each is made of SUM all-reduces in which the first replica of the worker that owns a part
contributes it and every other replica zeros (a broadcast), or each worker's first replica its
own part (a sum; a gather: its slice of a vector laid end to end). Sums of zeros and one value
are exact in every dtype. ``replica_id_in_sync_group`` numbers workers' replicas
consecutively, the chief's first (``consumer.cluster.strategy``: worker index 0), so replica
``i * local`` is worker ``i``'s first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf


def _first_replicas_sum(
    strategy: tf.distribute.Strategy, parts: Sequence[Any], chief_only: bool = False
) -> list[Any]:
    """``parts`` (tensors or arrays, this worker's) summed over the workers, each worker's
    first replica adding its own (``chief_only``: worker 0's only) and every other replica
    zeros; numpy arrays, the same on every worker."""
    tensors = [tf.convert_to_tensor(p) for p in parts]
    key = (id(strategy), chief_only)
    if key not in _TOTALS:
        _TOTALS[key] = _total(strategy, chief_only)
    summed = strategy.experimental_local_results(_TOTALS[key](tensors))[0]
    return [np.asarray(s) for s in summed]


# One traced function per strategy and kind, its shapes relaxed (``reduce_retracing``): the
# byte vectors differ in length at every checkpoint.
_TOTALS: dict[tuple[int, bool], Any] = {}


def _total(strategy: tf.distribute.Strategy, chief_only: bool) -> Any:
    local = len(strategy.extended.worker_devices)

    @tf.function(reduce_retracing=True)
    def total(values: list[tf.Tensor]) -> Any:
        def replica() -> Any:
            context = tf.distribute.get_replica_context()
            replica = context.replica_id_in_sync_group
            first = replica == 0 if chief_only else replica % local == 0
            mine = [tf.where(first, v, tf.zeros_like(v)) for v in values]
            # One all-reduce per dtype (the strategy packs a list into one tensor), in the
            # same order on every worker.
            out: list[Any] = [None] * len(mine)
            for dtype in sorted({v.dtype for v in mine}, key=lambda d: d.name):
                where = [i for i, v in enumerate(mine) if v.dtype == dtype]
                summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [mine[i] for i in where])
                for i, value in zip(where, summed, strict=True):
                    out[i] = value
            return out

        return strategy.run(replica)

    return total


def broadcast_bytes(
    strategy: tf.distribute.Strategy, index: int, count: int, data: bytes | None
) -> bytes:
    """Worker 0's ``data`` on every worker (the others pass None; so may worker 0: b"")."""
    parts = gather_bytes(strategy, index, count, (data or b"") if index == 0 else b"")
    return parts[0]


def gather_bytes(
    strategy: tf.distribute.Strategy, index: int, count: int, data: bytes
) -> list[bytes]:
    """Every worker's ``data``, in worker order, on every worker: two all-reduces (the
    lengths, then the bytes laid end to end)."""
    lengths = np.zeros(count, np.int64)
    lengths[index] = len(data)
    (lengths,) = _first_replicas_sum(strategy, [lengths])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    laid = np.zeros(max(int(offsets[-1]), 1), np.int32)  # int32: the collectives' smallest int
    laid[offsets[index] : offsets[index + 1]] = np.frombuffer(data, np.uint8)
    (laid,) = _first_replicas_sum(strategy, [laid])
    return [laid[offsets[i] : offsets[i + 1]].astype(np.uint8).tobytes() for i in range(count)]


def broadcast_variables(strategy: tf.distribute.Strategy, variables: Sequence[Any]) -> None:
    """Assign worker 0's value of each variable on every worker (an all-reduce per dtype)."""
    if not variables:
        return
    values = [tf.convert_to_tensor(v.value if hasattr(v, "value") else v) for v in variables]
    summed = _first_replicas_sum(strategy, values, chief_only=True)
    for variable, value in zip(variables, summed, strict=True):
        variable.assign(value)


def sum_over_workers(strategy: tf.distribute.Strategy, values: Sequence[float]) -> list[float]:
    """Every worker's ``values`` summed over the cluster, the same list on every worker (after
    the loop, before any worker raises its own failure)."""
    (summed,) = _first_replicas_sum(strategy, [np.asarray(values, np.float64)])
    return [float(v) for v in summed]
