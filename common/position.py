"""The input position: which batches of each shard's stream a model has trained (resume).

A *shard* is a stream identity that survives restarts: worker ``i`` of the ``n`` workers of a
``stagefeed produce --workers n`` (or ``run --producers n``), never a process id. A shard
numbers its batches ``0, 1, 2, ...`` along its whole stream (every pass of its source), and
that number is the batch's ``seq`` on the wire: a producer that resumes at batch ``k`` sends
``k`` first.

``StreamPosition`` is what was trained of one shard: every batch below ``next`` (the
low-water mark), plus ``above``, the few trained batches past it (several enqueue threads and
the queue's credit window let batches be trained out of order). It holds what was trained,
never a guess: the train loop adds a batch once its step has run.

``end`` is where the shard's stream ends, once its producer said so (``end {seq}``), else
null: a fact about the stream, kept so that a resumed trainer knows a shard is complete even
when its producer is gone.

``InputPosition`` is that for every shard, in the checkpoint's state file (``"input"``)::

    {"version": 1, "shards": 2, "approximate": [1],
     "streams": {"0": {"next": 57, "above": [59], "end": null},
                 "1": {"next": 96, "above": [], "end": 96}}}

``passes`` (a stream's key only once its producer ended a pass: sources with passes,
docs/resume.md "Passes") is where each ended pass of the shard ended, ascending ``seq``s:
pass ``k`` is batches ``passes[k-1]..passes[k]-1``.

``approximate`` lists the shards whose source could not seek (the producer fast-forwarded
it): their position is exact only if that source replays the same batches.

``order`` (a key only when the producers said it: a ``MapSource``) is the data's order
(``common.data_order.DataOrder``): it says which records each batch of each shard holds, so
the position can be dealt out to another shard count (``consumer.books.redeal``) and a
producer of another dataset, seed or shuffle setting is refused.

Read back from a file (``from_dict``), every number is checked: a count in ``[0, MAX_SEQ]``
(far inside the wire's ``seq`` below 2**63 and TensorFlow's int64, and exact as a float), a
shard key the ASCII digits of a shard in range; anything else is a ``ConfigError`` naming it.

Merging (several trainer workers of one cluster, each booking the batches it trained):
``InputPosition.merge`` is the union of the trained sets, shard by shard. No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeGuard

from stagefeed.common.data_order import DataOrder
from stagefeed.common.errors import ConfigError

VERSION = 1
MAX_SHARDS = 4096
MAX_RANGES = 256  # ranges a welcome's ``skip`` carries at most (the rest is deduplicated)
MAX_SEQ = 2**53  # the largest seq, end or pass boundary a position read from a file may hold
COUNTS = "[0, 2**53]"  # the counts up to MAX_SEQ, as a refusal says them


@dataclasses.dataclass
class StreamPosition:
    """Trained batches of one shard: all below ``next``, and ``above`` (each > ``next``)."""

    next: int = 0
    above: set[int] = dataclasses.field(default_factory=set)
    end: int | None = None  # the stream's length, once its producer said ``end``
    passes: list[int] = dataclasses.field(default_factory=list)  # where each ended pass ended

    def __contains__(self, seq: int) -> bool:
        return seq < self.next or seq in self.above

    def add(self, seq: int) -> None:
        if seq in self:
            return
        self.above.add(seq)
        while self.next in self.above:
            self.above.discard(self.next)
            self.next += 1

    def union(self, other: StreamPosition) -> StreamPosition:
        """Batches trained in either (every batch below the larger ``next`` is in one)."""
        ends = [e for e in (self.end, other.end) if e is not None]
        passes = self.passes if len(self.passes) >= len(other.passes) else other.passes
        out = StreamPosition(max(self.next, other.next), set(), max(ends) if ends else None,
                             list(passes))  # fmt: skip
        for seq in sorted(self.above | other.above):
            if seq >= out.next:
                out.add(seq)
        return out

    def ranges(self, limit: int = MAX_RANGES) -> list[list[int]]:
        """``above`` as sorted inclusive ``[first, last]`` runs, at most ``limit`` of them."""
        runs: list[list[int]] = []
        for seq in sorted(self.above):
            if runs and runs[-1][1] == seq - 1:
                runs[-1][1] = seq
            elif len(runs) < limit:
                runs.append([seq, seq])
            else:
                break
        return runs

    def to_dict(self) -> dict[str, Any]:
        out = {"next": self.next, "above": sorted(self.above), "end": self.end}
        return {**out, "passes": list(self.passes)} if self.passes else out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> StreamPosition:
        if not isinstance(data, Mapping) or set(data) - {"passes"} != {"next", "above", "end"}:
            raise ConfigError(f"{where}: expected {{next, above, end}}, got {str(data)[:80]}")
        nxt, above, end = data["next"], data["above"], data["end"]
        passes = data.get("passes", [])
        if not isinstance(passes, list) or not all(is_count(s) for s in passes) or any(
            a > b for a, b in zip(passes, passes[1:], strict=False)
        ):
            raise ConfigError(f"{where}: passes must be ascending counts in {COUNTS}, "
                              f"got {str(passes)[:80]}")  # fmt: skip
        if not is_count(nxt) or not isinstance(above, list) or not all(is_count(s) for s in above):
            raise ConfigError(f"{where}: next and above must be counts in {COUNTS}, got "
                              f"{str(data)[:80]}")  # fmt: skip
        if any(s <= nxt for s in above):
            raise ConfigError(f"{where}: every 'above' must be past next={nxt}")
        if end is not None and not is_count(end):
            raise ConfigError(f"{where}: end must be a count in {COUNTS} or null, got "
                              f"{str(end)[:80]}")  # fmt: skip
        return cls(nxt, set(above), end, passes)


def skip_of(ranges: Iterable[Iterable[int]]) -> Iterator[int]:
    """Every batch number of ``[first, last]`` ranges (a welcome's ``skip``)."""
    for first, last in ranges:
        yield from range(first, last + 1)


@dataclasses.dataclass
class InputPosition:
    """Every shard's ``StreamPosition`` (see the module docstring)."""

    shards: int
    streams: dict[int, StreamPosition] = dataclasses.field(default_factory=dict)
    approximate: set[int] = dataclasses.field(default_factory=set)
    order: DataOrder | None = None

    def of(self, shard: int) -> StreamPosition:
        return self.streams.setdefault(shard, StreamPosition())

    def merge(self, other: InputPosition) -> InputPosition:
        """The union of two workers' books (the same shards)."""
        if other.shards != self.shards:
            raise ConfigError(f"cannot merge positions of {self.shards} and {other.shards} shards")
        if self.order and other.order and self.order != other.order:
            raise ConfigError(f"cannot merge positions of two orders: {self.order.describe()} "
                              f"and {other.order.describe()}")  # fmt: skip
        out = InputPosition(self.shards, approximate=self.approximate | other.approximate,
                            order=self.order or other.order)  # fmt: skip
        for shard in set(self.streams) | set(other.streams):
            out.streams[shard] = self.of(shard).union(other.of(shard))
        return out

    def to_dict(self) -> dict[str, Any]:
        out = {
            "version": VERSION,
            "shards": self.shards,
            "approximate": sorted(self.approximate),
            "streams": {str(s): p.to_dict() for s, p in sorted(self.streams.items())},
        }
        return {**out, "order": self.order.to_dict()} if self.order else out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> InputPosition:
        """``ConfigError`` naming ``where`` if ``data`` is not a position of this version."""
        if not isinstance(data, Mapping) or data.get("version") != VERSION:
            raise ConfigError(f"{where}: not an input position of version {VERSION}")
        shards = data.get("shards")
        if not is_count(shards) or not 0 < shards <= MAX_SHARDS:
            raise ConfigError(f"{where}: shards must be in [1, {MAX_SHARDS}], got "
                              f"{str(shards)[:80]}")  # fmt: skip
        streams, approximate = data.get("streams"), data.get("approximate")
        if not isinstance(streams, Mapping) or not isinstance(approximate, list):
            raise ConfigError(f"{where}: streams must be a map and approximate a list")
        wrong = [a for a in approximate if not (is_count(a) and a < shards)]
        if wrong:
            raise ConfigError(f"{where}: approximate shard {str(wrong[0])[:80]} is not in "
                              f"[0, {shards})")  # fmt: skip
        order = data.get("order")
        out = cls(shards, approximate=set(approximate),
                  order=None if order is None else DataOrder.from_dict(order, f"{where} order"))
        for key, value in streams.items():
            shard = _shard_key(key)
            if shard is None or shard >= shards:
                raise ConfigError(f"{where}: shard {str(key)[:80]!r} is not in [0, {shards})")
            out.streams[shard] = StreamPosition.from_dict(value, f"{where} shard {key}")
        return out


def epoch_of(position: InputPosition) -> int:
    """The epochs a position has completed: every shard ended them and all of them is
    trained (0 without pass ends)."""
    epoch = 0
    while position.shards and all(
        len(position.of(s).passes) > epoch and position.of(s).next >= position.of(s).passes[epoch]
        for s in range(position.shards)
    ):
        epoch += 1
    return epoch


def passes_trained(position: InputPosition) -> int | None:
    """``epoch_of(position)`` for a position with pass ends (a source with passes); None
    without any."""
    if not any(s.passes for s in position.streams.values()):
        return None
    return epoch_of(position)


def is_count(value: Any) -> TypeGuard[int]:
    """A JSON count: an int (not a bool) in ``[0, MAX_SEQ]``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEQ


def _shard_key(key: Any) -> int | None:
    """A streams key as its shard: ASCII digits of a number below ``MAX_SHARDS`` (not "²",
    not thousands of digits), else None."""
    digits = isinstance(key, str) and key.isascii() and key.isdigit()
    if digits and len(key) <= len(str(MAX_SHARDS)):
        return int(key)
    return None
