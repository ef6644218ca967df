"""Where batches come from: the built-in synthetic source or the user's own generator."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
from stagefeed.common.errors import ConfigError
from stagefeed.common.spec import IMAGES, LABELS, BatchSpec

log = logging.getLogger(__name__)

Arrays = list[tuple[str, np.ndarray]]
# A user source: ``factory(spec, worker_index)`` returning an iterable of {"images", "labels"}.
SourceFactory = Callable[[BatchSpec, int], Iterable[Mapping[str, np.ndarray]]]


class SyntheticSource:
    """Seed-shaped random batches from a pool of preallocated buffers, reused round-robin.

    The pool is filled once at start (the RNG costs ~96 ms for one 158 MB float32 batch), so a
    producer's cost per batch is the transport, not the data. ``reuses_buffers`` tells the
    sender that a buffer must not be handed out again until ZeroMQ has sent it: with
    ``pool_size == max_unsent + 1`` the buffer about to be reused is always the sent one.
    """

    reuses_buffers = True

    def __init__(self, spec: BatchSpec, pool_size: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.pool: list[Arrays] = []
        for _ in range(pool_size):
            if spec.image_dtype == "uint8":
                images = rng.integers(0, 256, size=spec.image_shape, dtype=np.uint8)
            else:
                images = rng.random(spec.image_shape, dtype=np.float32)
            labels = rng.integers(0, spec.num_classes, size=spec.label_shape, dtype=np.int32)
            self.pool.append([(IMAGES, images), (LABELS, labels)])

    def __iter__(self) -> Iterator[Arrays]:
        while True:
            yield from self.pool


class UserSource:
    """Wraps ``module:function`` and checks every batch against the spec before it is sent."""

    reuses_buffers = False  # user arrays are fresh objects; ZeroMQ keeps them alive

    def __init__(self, ref: str, spec: BatchSpec, worker_index: int) -> None:
        self.ref = ref
        self.spec = spec
        module_name, _, attr = ref.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"source {ref!r} cannot be loaded: {exc}") from exc
        if not callable(factory):
            raise ConfigError(f"source {ref!r} is not callable")
        self._iterable = factory(spec, worker_index)

    def __iter__(self) -> Iterator[Arrays]:
        for n, batch in enumerate(self._iterable):
            yield self._check(n, batch)

    def _check(self, n: int, batch: Mapping[str, np.ndarray]) -> Arrays:
        if not isinstance(batch, Mapping) or set(batch) != {IMAGES, LABELS}:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ConfigError(
                f"source {self.ref!r} batch {n}: expected keys images, labels, got {keys}"
            )
        out: Arrays = []
        for name, dtype, shape in self.spec.arrays():
            array = np.ascontiguousarray(batch[name])
            if array.dtype != dtype or array.shape != shape:
                raise ConfigError(
                    f"source {self.ref!r} batch {n}: {name} is {array.dtype}{list(array.shape)}, "
                    f"expected {dtype}{list(shape)}"
                )
            out.append((name, array))
        labels = out[1][1]
        if labels.min() < 0 or labels.max() >= self.spec.num_classes:
            raise ConfigError(
                f"source {self.ref!r} batch {n}: labels outside [0, {self.spec.num_classes})"
            )
        return out


def open_source(ref: str, spec: BatchSpec, worker_index: int, pool_size: int, seed: int):
    """The source named by ``--source``: ``synthetic`` or ``module:function``."""
    if ref == "synthetic":
        return SyntheticSource(spec, pool_size, seed)
    return UserSource(ref, spec, worker_index)
