"""Which records each batch holds: an epoch's order, cut into batches, dealt to shards.

Epoch ``e``'s order is a permutation of ``range(n)`` drawn from ``(seed, e)``
(``numpy.random.default_rng([seed, e])``), or ``range(n)`` itself without shuffling. Global
batch ``b`` of the epoch is the records at places ``b*B .. (b+1)*B - 1`` of that order, and
shard ``i`` of ``k`` carries global batches ``i, i+k, i+2k, ...``: its ``s``-th batch of the
epoch is global batch ``i + s*k``. So what batch ``b`` holds depends on ``(seed, e, b)``
only, never on how many producers there are: with 1 producer or 3 the epoch is the same
batches, dealt out differently, and the shards' parts are disjoint and cover every batch.

The tail (``n % B`` records, the last places of the order) makes no full batch: under
``--short-batch drop`` it is left out of the epoch (other records each epoch when shuffled);
under ``refuse`` (the default) a source whose records do not divide into batches is refused
at start, before anything is sent.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stagefeed.common.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampler:
    """``records`` records in batches of ``batch_size``, shuffled per epoch from ``seed``."""

    records: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.records < 1 or self.batch_size < 1:
            raise ConfigError(f"sampler: {self.records} records, batch size {self.batch_size}")

    @property
    def batches(self) -> int:
        """Full batches per epoch."""
        return self.records // self.batch_size

    @property
    def tail(self) -> int:
        """Records per epoch that make no full batch."""
        return self.records % self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of every record index (int64)."""
        if not self.shuffle:
            return np.arange(self.records, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.records)

    def shard_batches(self, index: int, count: int) -> range:
        """The global batches shard ``index`` of ``count`` carries, in its order."""
        return range(index, self.batches, count)

    def batch(self, order: np.ndarray, number: int) -> np.ndarray:
        """The record indices of global batch ``number`` of the epoch whose ``order`` it is."""
        return order[number * self.batch_size : (number + 1) * self.batch_size]
