"""Elastic resume: a checkpoint's input position of ``k`` shards dealt out to ``k'``.

A position names, per shard, which batches of its stream were trained. With the data's order
(``common.data_order.DataOrder``: a ``MapSource``'s producers say it) each of those is a
global batch: shard ``i`` of ``k`` carries global batches ``i, i+k, ...`` of every epoch, one
pass an epoch, so its batch ``s`` is global batch ``i + (s % n_i) * k`` of epoch
``s // n_i`` (``n_i``: its batches per epoch). ``redeal`` maps every trained batch to that
global place, then reads the same places back through the new count's deal. The records a
global batch holds depend on ``(seed, epoch, batch)`` only, so the set of trained *records*
is unchanged: every record is still trained exactly once per epoch. What changes is the
order in which the rest of an epoch arrives (the shards interleave differently).

The new position has the epochs the old one ended as ended passes (``passes``), no ``end``
(the producers say it again) and the same order. Refused (``ConfigError``, one line):
a position without an order, with an approximate shard, or whose pass ends do not match
the order's deal (another source wrote it).

Trainer workers (``check_even``): a checkpoint resumes exactly on ``K`` workers of a cluster
only if it leaves them as many batches. Worker ``G`` is fed by ``--shard-group G/K``, whose
shards ``G, G+K, ...`` (``producer.worker.worker_info``) carry the global batches ``= G mod
K`` at any producer count; a step trains a batch on every worker, so the cluster stops at the
step where the first worker has none left. The same number of workers as the checkpoint's, or
one that divides it, always passes (each new worker's batches are whole old workers'); another
number usually does not, and is refused at start in one line on every worker.
"""

from __future__ import annotations

import numpy as np

from stagefeed.common.data_order import DataOrder
from stagefeed.common.errors import ConfigError
from stagefeed.common.position import InputPosition, StreamPosition, epoch_of


def redeal(position: InputPosition, shards: int) -> InputPosition:
    """``position`` dealt out to ``shards`` shards (see the module docstring)."""
    order = position.order
    if order is None:
        raise ConfigError("its batches name no data order (only a built-in data source or "
                          "a stagefeed.MapSource does): resume with the same shard count")
    if position.approximate:
        raise ConfigError(f"shards {sorted(position.approximate)} could not seek: their "
                          "position is approximate")  # fmt: skip
    trained = global_trained(position, order)
    # The epochs the old position ended, as the trainer's resume plan counts them (an epoch
    # trained in full whose pass ends were not all said yet is ended by the new producers).
    done = epoch_of(position)
    out = InputPosition(shards, order=order)
    for shard in range(shards):
        mine = trained[:, shard::shards].reshape(-1)  # epoch-major: index = the shard's seq
        missing = np.flatnonzero(~mine)
        low = int(missing[0]) if len(missing) else len(mine)
        above = {int(s) for s in np.flatnonzero(mine[low:]) + low}
        passes = [order.shard_batches(shard, shards) * (e + 1) for e in range(done)]
        if low or above or passes:
            out.streams[shard] = StreamPosition(low, above, None, passes)
    return out


def global_trained(position: InputPosition, order: DataOrder) -> np.ndarray:
    """``[epochs, batches]`` booleans: which global batch of which epoch was trained (up to one
    row past the last epoch touched)."""
    old = position.shards
    places: list[np.ndarray] = []
    for shard, stream in position.streams.items():
        per_epoch = order.shard_batches(shard, old)
        seqs = np.concatenate([np.arange(stream.next, dtype=np.int64),
                               np.fromiter(sorted(stream.above), np.int64)])  # fmt: skip
        wrong = [p for e, p in enumerate(stream.passes) if p != per_epoch * (e + 1)]
        if wrong or (len(seqs) and not per_epoch):
            raise ConfigError(f"shard {shard} of {old}'s pass ends {stream.passes[:4]} do not "
                              f"match {order.describe()}")  # fmt: skip
        if len(seqs):
            epochs, within = np.divmod(seqs, per_epoch)
            places.append(epochs * order.batches + shard + within * old)
    flat = np.concatenate(places) if places else np.zeros(0, np.int64)
    epochs = int(flat.max()) // order.batches + 2 if len(flat) else 1
    trained = np.zeros(epochs * order.batches, bool)
    trained[flat] = True
    return trained.reshape(epochs, order.batches)


def check_even(position: InputPosition, workers: int, where: str) -> None:
    """``ConfigError`` (one line naming ``where``, the checkpoint) unless ``position`` leaves
    each of ``workers`` workers as many batches to train (see the module docstring)."""
    if workers < 2:
        return
    if position.order is not None:
        trained = global_trained(position, position.order)
        done = [int(trained[:, w::workers].sum()) for w in range(workers)]
    elif position.shards % workers == 0:  # no order: the shards stay, group w has w, w+K, ...
        done = [0] * workers
        for shard, stream in position.streams.items():
            done[shard % workers] += stream.next + len(stream.above)
    else:
        return  # another shard count, refused at the producers' hellos
    if len(set(done)) > 1:
        raise ConfigError(
            f"{where} cannot resume exactly on {workers} trainer workers: its workers' groups "
            f"of shards hold {done} trained batches, and a cluster steps on every worker at "
            "once, so it would stop with batches of some untrained; resume on the number of "
            "workers that wrote it, one that divides it, or one trainer"
        )
