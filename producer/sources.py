"""Where batches come from: the source contract, the built-in ``synthetic`` source, user sources.

A source is a factory ``source(schema, worker)``, named on the command line as
``--source mypkg.mod:fn`` (imported from the current directory, as ``python -m`` would). It
gets the agreed ``Schema`` (declared by the producer's batch flags, or the trainer's) and a
``WorkerInfo`` (``index`` / ``count`` to shard, ``seed`` to be reproducible), and returns one
of two forms.

(a) An iterable of ``{name: ndarray}`` dicts, each batch fresh arrays (ZeroMQ keeps a reference
until it has sent them, so the source must not write into a batch it has yielded)::

    def batches(schema, worker):
        rng = np.random.default_rng(worker.seed)
        for path in worker.shard(sorted(glob.glob("data/*.npz"))):
            with np.load(path) as f:
                yield {"features": f["x"], "token_ids": f["ids"], "targets": f["y"]}

(b) A *filling* source: an object with ``fill(out) -> bool`` that writes one batch into the
preallocated, 64-byte-aligned arrays of ``out`` (one per schema array, in wire order) and
returns False at the end of the data. It must write into those arrays, never replace them.
The producer hands ``fill`` a buffer only once ZeroMQ has released it (with shared memory:
a slot of the pool, once the trainer has released it), so writing is always safe; it saves
the copy a fresh array costs, and over shared memory it is the only write the batch takes::

    class Noise:
        def __init__(self, schema, worker):
            self.rng = np.random.default_rng(worker.seed)

        def fill(self, out):
            self.rng.random(out=out["features"])
            out["targets"][:] = out["features"].sum(axis=1)
            return True

    def noise(schema, worker):
        return Noise(schema, worker)

Every batch is checked with ``common.schema.check_arrays`` before it is sent (names, dtypes,
shapes, bounds): a mismatch is a ``SchemaMismatch`` naming the source, the batch, the array,
what was expected and what came. A source that ends makes the producer finish cleanly.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from stagefeed.common.errors import BrokenError, ConfigError
from stagefeed.common.refs import import_ref
from stagefeed.common.schema import Schema, SchemaMismatch, check_arrays
from stagefeed.producer.buffers import BufferPool
from stagefeed.producer.synthetic import SyntheticSource

T = TypeVar("T")
SYNTHETIC = "synthetic"

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Which producer process a source runs in: worker ``index`` of ``count``.

    ``index`` and ``count`` are global: worker ``i`` of ``produce --workers N --shard-group
    G/K`` is ``G*N + i`` of ``K*N`` (``producer.worker.worker_info``), so sources that split
    their data by them split it across every group. ``producer_id`` is unique per process
    run (host, pid, index, nonce); ``seed`` is ``--seed + index``, so a run is reproducible
    and workers differ.

    ``index`` of ``count`` is also the *shard* the producer says it carries (docs/resume.md):
    an identity that survives restarts. ``start`` is the batch of this shard's stream the
    source must yield first (0 unless a trainer resumed from a checkpoint): a *seekable*
    source (``is_seekable``) honours it; any other is read from its first batch and the
    producer discards the batches before ``start`` (exact only if the source replays the
    same batches: the trainer calls that shard's position approximate).

    ``epoch``: the pass a *passing* source (``is_passing``) makes in this call (0, 1, ...;
    docs/resume.md, "Passes"); its ``start`` then counts from the pass's first batch.
    """

    index: int
    count: int
    producer_id: str
    seed: int
    start: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        for name in ("index", "count", "seed", "start", "epoch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"WorkerInfo.{name} must be an integer, got {value!r}")
        if self.start < 0 or self.epoch < 0:
            raise ConfigError(f"WorkerInfo.start and epoch must be >= 0, got {self!r}")
        if not 0 <= self.index < self.count:
            raise ConfigError(f"WorkerInfo.index {self.index} is not in [0, {self.count})")
        if not isinstance(self.producer_id, str) or not self.producer_id:
            raise ConfigError("WorkerInfo.producer_id must be a non-empty string")

    def shard(self, items: Sequence[T]) -> Sequence[T]:
        """This worker's share of ``items``: every ``count``-th one, starting at ``index``."""
        return items[self.index :: self.count]


class SourceFailed(Exception):
    """Carries the error a source raised (``ConfigError``/``BrokenError``) past the code that
    also raises the channel's errors: the producer delivers what it made, then raises it."""

    def __init__(self, error: ConfigError | BrokenError) -> None:
        super().__init__(str(error))
        self.error = error


class FillingSource(Protocol):
    def fill(self, out: dict[str, np.ndarray]) -> bool: ...


SourceFactory = Callable[[Schema, WorkerInfo], Iterable[Mapping[str, Any]] | FillingSource]
Release = Callable[[], None]


def is_seekable(factory: SourceFactory | None) -> bool:
    """Whether a source factory declared it can start at any batch of its stream
    (``factory.seekable = True``: it reads ``worker.start``). The synthetic source need not."""
    return getattr(factory, "seekable", False) is True


def is_passing(factory: SourceFactory | None) -> bool:
    """Whether a source factory makes one pass of its shard per call (``factory.passes =
    True``: it reads ``worker.epoch``), so the producer can wait for the trainer between
    passes and an epoch is every shard's pass (docs/resume.md, "Passes")."""
    return getattr(factory, "passes", False) is True


def resolve_source(ref: str) -> SourceFactory | None:
    """The factory ``--source ref`` names (``None`` for ``synthetic``); ``ConfigError`` if it
    cannot be imported or is not callable. Cheap: call it before connecting, to fail early.
    """
    if ref == SYNTHETIC:
        return None
    factory = import_ref(ref, "--source")
    if not callable(factory):
        raise ConfigError(f"--source {ref!r} is a {type(factory).__name__}, not a function")
    return factory


class BatchStream:
    """Checked batches from one source, in sending order. Used from one thread. (Not the
    trainer's ``stagefeed.Feed``, the queue a training loop reads: docs/architecture.md,
    "Glossary".)

    ``next()`` returns ``(arrays, release)`` or ``None`` at the end of the data. ``arrays`` is
    a dict of C-contiguous arrays exactly matching the schema. ``release`` is ``None`` when the
    arrays need no tracking (fresh arrays, or the synthetic pool that is never rewritten);
    otherwise it must be called once ZeroMQ has released every frame of the batch, and it is
    what lets the buffer be filled again.
    """

    def __init__(self, name: str, schema: Schema) -> None:
        self.name = name
        self.schema = schema
        self.count = 0

    def next(self) -> tuple[dict[str, np.ndarray], Release | None] | None:
        raise NotImplementedError

    def fill_into(self, out: dict[str, np.ndarray]) -> bool:
        """Write the next batch into ``out`` (a shared-memory slot's arrays, one per schema
        array); False at the end of the data. Here: take the next batch and copy it in (a
        filling source writes into ``out`` itself, see ``FillingStream``)."""
        item = self.next()
        if item is None:
            return False
        arrays, release = item
        for name in self.schema.names:
            np.copyto(out[name], arrays[name])
        if release is not None:
            release()
        return True

    def _check(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
        check_arrays(self.schema, arrays, f"source {self.name!r} batch {self.count}")
        out = {name: np.ascontiguousarray(arrays[name]) for name in self.schema.names}
        self.count += 1
        return out

    def _user_failed(self, exc: Exception) -> BrokenError:
        return BrokenError(
            f"source {self.name!r} failed at batch {self.count}: {type(exc).__name__}: {exc}"
        )


class IterableStream(BatchStream):
    """Form (a): batches from an iterable of dicts (fresh arrays, or a never-rewritten pool).

    A *short* batch (every array has the schema's dtype and row shape but the same, smaller
    number of rows: the last batch of data that does not divide by the batch size) is
    refused with its own message (``short_batch="refuse"``) or dropped, counted and logged
    (``"drop"``, tf.data's ``drop_remainder``). Never padded: that would train invented rows.
    """

    def __init__(
        self,
        name: str,
        schema: Schema,
        iterable: Iterable[Mapping[str, Any]],
        short_batch: str = "refuse",
    ) -> None:
        super().__init__(name, schema)
        self.short_batch = short_batch
        self.short_dropped = 0  # short batches dropped, and their rows
        self.short_rows_dropped = 0
        try:
            self._iterator: Iterator[Mapping[str, Any]] = iter(iterable)
        except TypeError:
            raise ConfigError(
                f"source {name!r} returned a {type(iterable).__name__}: neither an iterable of "
                "dicts nor an object with fill(out)"
            ) from None

    def next(self) -> tuple[dict[str, np.ndarray], None] | None:
        while True:
            try:
                batch = next(self._iterator)
            except StopIteration:
                return None
            except (ConfigError, BrokenError):
                raise
            except Exception as exc:  # noqa: BLE001 - user code: carried as one line
                raise self._user_failed(exc) from exc
            rows = short_rows(self.schema, batch)
            if rows is None:
                return self._check(batch), None
            what = f"source {self.name!r} batch {self.count}"
            if self.short_batch != "drop":
                raise SchemaMismatch(
                    f"{what} is short: {rows} rows, the batch size is {self.schema.batch_size} "
                    "(the end of data that does not divide by it?); pass --short-batch drop "
                    "to drop short batches (like tf.data's drop_remainder)"
                )
            self.short_dropped += 1
            self.short_rows_dropped += rows
            log.warning("%s is short (%d of %d rows): dropped (--short-batch drop)",
                        what, rows, self.schema.batch_size)  # fmt: skip
            self.count += 1


def short_rows(schema: Schema, arrays: Any) -> int | None:
    """The row count of a short batch: the schema's names, dtypes and row shapes with fewer
    rows than the batch size, the same number in every array; else None."""
    if not isinstance(arrays, Mapping) or set(arrays) != set(schema.names):
        return None
    rows = set()
    for spec in schema.arrays:
        array = arrays[spec.name]
        full = schema.batch_shape(spec)
        if not isinstance(array, np.ndarray) or array.dtype != spec.np_dtype:
            return None
        if array.ndim != len(full) or array.shape[1:] != full[1:]:
            return None
        rows.add(array.shape[0] if array.ndim else -1)
    if len(rows) != 1:
        return None
    (count,) = rows
    return count if 0 <= count < schema.batch_size else None


class FillingStream(BatchStream):
    """Form (b): ``fill(out)`` writes into a ``BufferPool`` slot that ZeroMQ has released, or
    straight into a shared-memory slot (``fill_into``). The buffer pool is allocated on the
    first ``next()``: a producer that sends through shared memory never makes one."""

    def __init__(self, name: str, schema: Schema, source: FillingSource, pool_size: int) -> None:
        super().__init__(name, schema)
        self._source = source
        self._pool_size = pool_size
        self._pool: BufferPool | None = None

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            self._pool = BufferPool(self.schema, self._pool_size)
        return self._pool

    def next(self) -> tuple[dict[str, np.ndarray], Release] | None:
        pool = self.pool
        slot = pool.take()
        try:
            more = self._fill(pool.slots[slot])
        except BaseException:
            pool.give_back(slot)
            raise
        if not more:
            pool.give_back(slot)
            return None
        return pool.slots[slot], lambda: pool.give_back(slot)

    def fill_into(self, out: dict[str, np.ndarray]) -> bool:
        return self._fill(out)

    def _fill(self, buffers: dict[str, np.ndarray]) -> bool:
        """``fill`` into ``buffers``, then the checks; False at the end of the data."""
        out = dict(buffers)
        try:
            more = self._source.fill(out)
        except (ConfigError, BrokenError):
            raise
        except Exception as exc:  # noqa: BLE001 - user code may raise anything; carried as one line
            raise self._user_failed(exc) from exc
        if not more:
            return False
        replaced = [name for name in buffers if out.get(name) is not buffers[name]]
        if replaced:
            raise ConfigError(
                f"source {self.name!r} batch {self.count}: fill() replaced {', '.join(replaced)} "
                "instead of writing into the given arrays (out[name][...] = values)"
            )
        self._check(out)
        return True


def open_stream(
    ref: str,
    schema: Schema,
    worker: WorkerInfo,
    pool_size: int,
    factory: SourceFactory | None = None,
    short_batch: str = "refuse",
) -> BatchStream:
    """The ``BatchStream`` of ``--source ref`` for ``worker``. ``pool_size`` (``max_unsent + 1``) is
    the number of batches the synthetic pool and a filling source's buffer pool hold.
    ``factory``: the result of ``resolve_source(ref)``, if the caller already has it.
    ``short_batch``: ``refuse`` or ``drop`` a short batch (``IterableStream``).
    """
    if ref == SYNTHETIC:
        return IterableStream(ref, schema, SyntheticSource(schema, pool_size, worker.seed))
    if factory is None:
        factory = resolve_source(ref)
    try:
        made = factory(schema, worker)
    except (ConfigError, BrokenError):
        raise
    except Exception as exc:  # noqa: BLE001 - user code may raise anything; carried as one line
        raise BrokenError(
            f"source {ref!r} failed to start: {type(exc).__name__}: {exc}"
        ) from exc
    fill = getattr(made, "fill", None)
    if callable(fill):
        return FillingStream(ref, schema, made, pool_size)
    return IterableStream(ref, schema, made, short_batch)
