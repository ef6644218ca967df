"""The built-in ``synthetic`` source: random batches of any schema, generated once.

The RNG is the expensive part (~96 ms for one 158 MB float32 batch), so a pool of batches is
generated at start and then cycled: a producer's cost per batch is the transport, not the
data. Values: floats uniform in [0, 1), integers uniform in the array's ``bounds`` (or in
[0, 100) clipped to the dtype when it has none), bools fair coin flips.

Reuse is safe without any release tracking because the pool is never written after it is
generated: ZeroMQ may still be reading batch ``k`` when the same arrays are yielded again,
and both readers see the same, unchanging bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from stagefeed.common.schema import ArraySpec, Schema
from stagefeed.producer.buffers import allocate_batch

DEFAULT_INT_RANGE = (0, 100)


def random_fill(rng: np.random.Generator, spec: ArraySpec, out: np.ndarray) -> None:
    """Write random values of ``spec``'s kind into ``out`` (see the module docstring)."""
    kind = out.dtype.kind
    if kind == "f":
        if out.dtype.itemsize >= 4:
            rng.random(dtype=out.dtype, out=out.reshape(-1))
        else:  # float16: generate in float32, then keep the rounding below 1.0
            below_one = np.nextafter(out.dtype.type(1), out.dtype.type(0))
            values = rng.random(out.shape, dtype=np.float32)
            np.minimum(values, below_one, out=out, casting="unsafe")
    elif kind == "b":
        out[...] = rng.random(out.shape) < 0.5
    elif kind in "iu":
        low, high = spec.bounds if spec.bounds is not None else _default_range(out.dtype)
        out[...] = rng.integers(low, high, size=out.shape, dtype=out.dtype)
    else:
        raise TypeError(f"array {spec.name!r}: no synthetic values for dtype {out.dtype}")


def _default_range(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return max(DEFAULT_INT_RANGE[0], int(info.min)), min(DEFAULT_INT_RANGE[1], int(info.max) + 1)


class SyntheticSource:
    """``pool_size`` random batches of ``schema``, yielded round-robin forever.

    An iterable source (fresh-array form) whose arrays are reused but never rewritten: see
    the module docstring for why that is safe. ``seed`` makes the pool reproducible; producers
    pass ``WorkerInfo.seed`` so workers differ.
    """

    def __init__(self, schema: Schema, pool_size: int, seed: int = 0) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        rng = np.random.default_rng(seed)
        self.schema = schema
        self.pool: list[dict[str, np.ndarray]] = []
        for _ in range(pool_size):
            batch = allocate_batch(schema)
            for spec in schema.arrays:
                random_fill(rng, spec, batch[spec.name])
            self.pool.append(batch)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            yield from self.pool
