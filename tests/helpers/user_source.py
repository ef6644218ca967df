"""User-supplied sources for ``--source tests.helpers.user_source:NAME`` (used by the tests).

They follow the source contract of ``stagefeed.producer.sources``: ``fn(schema, worker)``
returning an iterable of ``{name: ndarray}`` dicts, or an object with ``fill(out) -> bool``.
"""

from __future__ import annotations

import time

import numpy as np


def batches(schema, worker):
    """Fresh arrays whose every value is the worker index, so a test can tell workers apart."""
    while True:
        yield {
            name: np.full(shape, worker.index, dtype=dtype) for name, dtype, shape in schema.wire()
        }


def sharded(schema, worker):
    """One batch per item of this worker's shard of range(10); each value is the item."""
    for item in worker.shard(range(10)):
        yield {name: np.full(shape, item, dtype=dtype) for name, dtype, shape in schema.wire()}


def short_last(schema, worker):
    """Two full batches, then the 3 rows left over (the end of data not divisible by it)."""
    for rows in (schema.batch_size, schema.batch_size, 3):
        yield {
            name: np.full((rows, *shape[1:]), 7, dtype=dtype)
            for name, dtype, shape in schema.wire()
        }


def wrong_shape(schema, worker):
    """A first batch whose first array is float32[1, 2, 3], whatever the schema says."""
    batch = {name: np.zeros(shape, dtype=dtype) for name, dtype, shape in schema.wire()}
    batch[schema.names[0]] = np.zeros((1, 2, 3), np.float32)
    yield batch


class Counting:
    """A filling source: batch ``k`` has every element of every array equal to ``k % 100``.

    A canary: whoever receives batch ``seq`` can check its bytes were not overwritten by a
    later ``fill`` while ZeroMQ was still sending them. ``limit`` batches, then the end.
    """

    def __init__(self, schema, worker, limit: int) -> None:
        self.count = 0
        self.limit = limit

    def fill(self, out: dict[str, np.ndarray]) -> bool:
        if self.count >= self.limit:
            return False
        for array in out.values():
            array[...] = self.count % 100
        self.count += 1
        return True


def counting(schema, worker):
    """The canary filling source, 24 batches."""
    return Counting(schema, worker, limit=24)


def counting_forever(schema, worker):
    return Counting(schema, worker, limit=2**62)


def slow_second(schema, worker):
    """Fresh zero batches; the second one comes after 5 s (a source blocking on I/O)."""
    batch = {name: np.zeros(shape, dtype=dtype) for name, dtype, shape in schema.wire()}
    for n in range(3):
        if n == 1:
            time.sleep(5.0)
        yield dict(batch)


def replaces_buffers(schema, worker):
    """A wrong filling source: assigns new arrays instead of writing into ``out``."""

    class Replacing:
        def fill(self, out):
            for name, dtype, shape in schema.wire():
                out[name] = np.zeros(shape, dtype)
            return True

    return Replacing()


def fails(schema, worker):
    """A source that raises on its second batch."""
    yield {name: np.zeros(shape, dtype=dtype) for name, dtype, shape in schema.wire()}
    raise KeyError("no such shard")


def wrong_dtype_at_3(schema, worker):
    """Three good batches (values = batch number), then one whose first array is float64."""
    for n in range(3):
        yield {name: np.full(shape, n, dtype=dtype) for name, dtype, shape in schema.wire()}
    batch = {name: np.zeros(shape, dtype=dtype) for name, dtype, shape in schema.wire()}
    name, _, shape = schema.wire()[0]
    batch[name] = np.zeros(shape, np.float64)
    yield batch


def labels_out_of_bounds_at_3(schema, worker):
    """Three good batches of the image schema, then labels past ``num_classes``."""
    for n in range(4):
        batch = {name: np.zeros(shape, dtype=dtype) for name, dtype, shape in schema.wire()}
        if n == 3:
            batch["labels"][:] = 10**6
        yield batch


not_callable = 42


def fails_to_start(schema, worker):
    """A source whose factory raises: it never makes a batch."""
    raise OSError("no data here")
