"""``MapSource``: records + sampler + transform as a source of the producer's contract.

``MapSource(records, ...)`` is a source factory (``producer.sources``) that makes passes
(``passes = True``: one epoch per call, ``worker.epoch``) and seeks (``seekable = True``:
it starts at ``worker.start``, the shard's batch within the epoch), so resume and epochs
work with the trainer as it is. ``MapSource(records, epochs=E)`` makes no passes: each call
is the shard's E epochs as one stream (``worker.start`` counts along all of them), for a
trainer that takes no passes (a cluster's workers: docs/resume.md, "Several trainer
workers"). Each call is this shard's full batches of that epoch (``sampler``), each record
read, transformed with its own generator (``transform``) and checked against the schema: a
``MapStream``, which writes each batch into the producer's buffer (over shared memory, the
slot the trainer reads: the records are copied once), or yields fresh arrays when iterated.

Bad records (``on_bad_record``): ``fail`` ends the source in one line naming the record's
file and index (a ``ConfigError``: exit 2); ``skip`` leaves the record out, counts it, logs
it (throttled), and fills its row with another record of the same batch, so the batch stays
full and global batch ``b`` stays where resume expects it. A batch whose every record is
bad ends the source. ``report()`` says what was skipped (the producer's final line).

A user module may make one at import and name it ``--source mymod:train``::

    train = MapSource(HFRecords(datasets.load_from_disk("data/train")), seed=7)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from stagefeed.common.checks import check_non_negative_int
from stagefeed.common.data_order import MAX_SEED, hello_fields
from stagefeed.common.data_ref import ON_BAD_RECORD
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import SHORT_BATCH
from stagefeed.common.schema import Schema
from stagefeed.common.throttle import LogThrottle
from stagefeed.producer.data.records import BadRecord, Records, check_names, fit_record
from stagefeed.producer.data.sampler import Sampler
from stagefeed.producer.data.transform import Transform, record_rng, resolve_transform
from stagefeed.producer.sources import WorkerInfo

log = logging.getLogger(__name__)

SHOWN_BAD = 3  # bad records named in ``report()``


class MapSource:
    """A passing, seekable source over ``records``; see the module docstring.

    ``seed`` draws each epoch's order and each record's generator (the same in every
    producer: ``--seed``); ``transform`` is a function or ``module:function``.
    """

    seekable = True

    def __init__(
        self,
        records: Records,
        *,
        shuffle: bool = True,
        seed: int = 0,
        transform: Transform | str | None = None,
        on_bad_record: str = "fail",
        short_batch: str = "refuse",
        name: str | None = None,
        epochs: int | None = None,
    ) -> None:
        if on_bad_record not in ON_BAD_RECORD:
            raise ConfigError(f"on_bad_record must be one of {', '.join(ON_BAD_RECORD)}, "
                              f"got {on_bad_record!r}")  # fmt: skip
        if short_batch not in SHORT_BATCH:
            raise ConfigError(f"short_batch must be one of {', '.join(SHORT_BATCH)}, "
                              f"got {short_batch!r}")  # fmt: skip
        if not len(records):
            raise ConfigError(f"{name or type(records).__name__}: no records")
        check_non_negative_int("seed", seed, MAX_SEED - 1)
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                                   or epochs < 1):  # fmt: skip
            raise ConfigError(f"epochs must be a positive integer or None, got {epochs!r}")
        # Passes (one epoch a call, the trainer's epochs) unless the epochs are given here.
        self.passes: bool = epochs is None
        self.epochs = epochs
        self.records = records
        self.name: str = name or str(getattr(records, "origin", type(records).__name__))
        self.shuffle, self.seed = shuffle, seed
        self.transform = resolve_transform(transform) if isinstance(transform, str) else transform
        self.on_bad_record, self.short_batch = on_bad_record, short_batch
        self.bad = 0
        self.bad_shown: list[str] = []
        self._throttle = LogThrottle()

    def hello_fields(self) -> dict[str, Any]:
        """The data's order for the producer's hello (``common.data_order``): the trainer
        keeps it with the position, refuses another, and deals a checkpoint out to another
        producer count."""
        return hello_fields(self.name, len(self.records), self.seed, self.shuffle)

    def sampler(self, batch_size: int) -> Sampler:
        """The sampler for batches of ``batch_size``; ``ConfigError`` when the records make
        no full batch, or leave a tail that ``short_batch`` refuses."""
        sampler = Sampler(len(self.records), batch_size, self.seed, self.shuffle)
        if not sampler.batches:
            raise ConfigError(
                f"{self.name}: {sampler.records} records make no batch of {batch_size}"
            )
        if sampler.tail and self.short_batch != "drop":
            raise ConfigError(
                f"{self.name}: {sampler.records} records are {sampler.batches} batches of "
                f"{batch_size} and {sampler.tail} left over; pass --short-batch drop to leave "
                "the last records of each epoch's order out (other ones each epoch when shuffled)"
            )
        return sampler

    def check(self, schema: Schema) -> None:
        """``ConfigError`` at start unless the records can fill ``schema``'s arrays."""
        if self.transform is not None:
            return  # the transform makes the arrays: checked per record
        fit = getattr(self.records, "fit", None)
        if callable(fit):
            fit(schema)  # read only what the schema uses, at its size
        fields = self.records.fields()
        check_names(schema, list(fields), self.name)
        for spec in schema.arrays:
            field = fields[spec.name]
            castable = np.can_cast(np.dtype(field.dtype), spec.np_dtype, "safe")
            if field.shape != spec.shape or not castable:
                raise ConfigError(
                    f"{self.name}: {spec.name} is {field.dtype}{list(field.shape)} a record, "
                    f"the schema says {spec.dtype}{list(spec.shape)}"
                )

    def __call__(self, schema: Schema, worker: WorkerInfo) -> MapStream:
        self.check(schema)
        sampler = self.sampler(schema.batch_size)
        if sampler.tail and worker.index == 0 and worker.start == 0:
            log.info("%s: epoch %d leaves out its last %d records (--short-batch drop)",
                     self.name, worker.epoch, sampler.tail)  # fmt: skip
        return MapStream(self, schema, self._plan(worker, sampler))

    def _plan(
        self, worker: WorkerInfo, sampler: Sampler
    ) -> Iterator[tuple[np.ndarray, int, int]]:
        """``(indices, epoch, number)`` of each batch of this call, in order."""
        mine = sampler.shard_batches(worker.index, worker.count)
        if self.epochs is None:  # one pass: this epoch, from the shard's batch ``start`` of it
            first, start, last = worker.epoch, worker.start, worker.epoch + 1
        else:  # every epoch as one stream: ``start`` counts along all of them
            first, start = divmod(worker.start, len(mine)) if len(mine) else (self.epochs, 0)
            last = self.epochs
        for epoch in range(first, last):
            order = sampler.order(epoch)
            for number in mine[start if epoch == first else 0 :]:
                yield sampler.batch(order, number), epoch, number

    def batch(
        self, schema: Schema, indices: np.ndarray, epoch: int, number: int
    ) -> dict[str, np.ndarray]:
        """Global batch ``number`` of epoch ``epoch``, the records ``indices``, in fresh
        arrays."""
        out = {s.name: np.empty(schema.batch_shape(s), s.np_dtype) for s in schema.arrays}
        self.write_batch(out, schema, indices, epoch, number)
        return out

    def write_batch(
        self, out: dict[str, np.ndarray], schema: Schema, indices: np.ndarray, epoch: int,
        number: int,
    ) -> None:
        """Global batch ``number`` of epoch ``epoch`` written into ``out`` (one array per
        schema array, each of the batch's shape: a shared-memory slot's, so that a record is
        written once, where the trainer reads it)."""
        take = getattr(self.records, "take", None)
        if self.transform is None and callable(take):
            arrays = take(indices)
            for spec in schema.arrays:
                out[spec.name][...] = arrays[spec.name]
            return
        bad_rows = []
        for row, index in enumerate(indices.tolist()):
            try:
                record = self._record(schema, index, epoch)
            except BadRecord as exc:
                self._bad(str(exc))
                bad_rows.append(row)
                continue
            for name, value in record.items():
                out[name][row] = value
        if bad_rows:
            self._fill(out, bad_rows, number, epoch)

    def _record(self, schema: Schema, index: int, epoch: int) -> dict[str, np.ndarray]:
        record: Any = self.records.record(index)
        if self.transform is not None:
            try:
                record = self.transform(record, record_rng(self.seed, epoch, index))
            except Exception as exc:  # noqa: BLE001 - user code: a bad record, named
                where = self.records.where(index)
                raise BadRecord(f"{where}: the transform failed: {type(exc).__name__}: {exc}") \
                    from None
        return fit_record(schema, record, self.records.where(index))

    def _bad(self, what: str) -> None:
        if self.on_bad_record == "fail":
            raise ConfigError(f"{self.name}: bad record: {what} (--on-bad-record skip to leave "
                              "such records out)")  # fmt: skip
        self.bad += 1
        if len(self.bad_shown) < SHOWN_BAD:
            self.bad_shown.append(what)
        if self._throttle.due("bad"):
            log.warning("%s: bad record skipped (%d so far): %s", self.name, self.bad, what)

    def _fill(self, out: dict[str, np.ndarray], bad_rows: list[int], number: int,
              epoch: int) -> None:  # fmt: skip
        """Give each bad row another record of the same batch (the good ones in turn)."""
        good = [row for row in range(len(next(iter(out.values())))) if row not in set(bad_rows)]
        if not good:
            raise ConfigError(f"{self.name}: every record of batch {number} of epoch {epoch} "
                              f"is bad, the first: {self.bad_shown[0]}")  # fmt: skip
        for k, row in enumerate(bad_rows):
            for array in out.values():
                array[row] = array[good[k % len(good)]]

    def skipped(self) -> tuple[int, str]:
        """Records left out so far, and the first of them named (the ``end`` tells them)."""
        return self.bad, self.bad_shown[0] if self.bad_shown else ""

    def report(self) -> str:
        """What was left out, for the producer's final line ('' if nothing)."""
        if not self.bad:
            return ""
        return (f"{self.bad} bad records skipped (--on-bad-record skip), the first: "
                + "; ".join(self.bad_shown))  # fmt: skip


class MapStream:
    """One call of a ``MapSource``: its batches, in order. A *filling* source
    (``producer.sources``): ``fill(out)`` writes the next batch into the producer's buffer
    (over shared memory, the slot itself: no copy of the batch); iterating yields each batch
    in fresh arrays instead."""

    def __init__(
        self, source: MapSource, schema: Schema, plan: Iterator[tuple[np.ndarray, int, int]]
    ) -> None:
        self._source, self._schema, self._plan = source, schema, plan

    def fill(self, out: dict[str, np.ndarray]) -> bool:
        """The next batch into ``out``; False at the end of the call's batches."""
        item = next(self._plan, None)
        if item is None:
            return False
        self._source.write_batch(out, self._schema, *item)
        return True

    def __iter__(self) -> MapStream:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        indices, epoch, number = next(self._plan)
        return self._source.batch(self._schema, indices, epoch, number)
