"""A data source's order: what makes global batch ``b`` of epoch ``e`` the same records at any
producer count, so that a position can be dealt out again (elastic resume, docs/resume.md).

A ``MapSource`` (``producer.data.source``) draws epoch ``e``'s order from ``(seed, e)`` over
``records`` records (or keeps file order without ``shuffle``) and cuts it into
``records // batch_size`` global batches; shard ``i`` of ``k`` carries global batches
``i, i+k, i+2k, ...`` of every epoch, one pass per epoch. Its hello says so
(``hello_fields``): ``order_source``, ``order_records``, ``order_seed``, ``order_shuffle``
(together; the batch size is the schema's). The trainer keeps it in the input position
(``"order"``) and refuses a producer whose order differs (another dataset, seed or shuffle
setting: the same position would name other records), and it is what lets a checkpoint of
``k`` shards resume with ``k'`` (``consumer.books.redeal``).

``shard_batches(i, k)`` is how many batches shard ``i`` of ``k`` carries per epoch. No
numpy, no TensorFlow here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from stagefeed.common.errors import ConfigError

MAX_RECORDS = 2**53
MAX_SEED = 2**63
MAX_SOURCE = 1024  # characters of a source's name


@dataclasses.dataclass(frozen=True)
class DataOrder:
    """``records`` records of ``source`` in batches of ``batch_size``, each epoch's order drawn
    from ``seed`` (or file order without ``shuffle``); see the module docstring."""

    source: str
    records: int
    batch_size: int
    seed: int
    shuffle: bool

    @property
    def batches(self) -> int:
        """Global batches per epoch (the tail that fills no batch is left out)."""
        return self.records // self.batch_size

    def shard_batches(self, index: int, count: int) -> int:
        """Batches per epoch of shard ``index`` of ``count``: global ``index, index+count, ...``."""
        return len(range(index, self.batches, count))

    def differs(self, other: DataOrder) -> str | None:
        """Why ``other`` is not this order (one line naming both), or None."""
        if self == other:
            return None
        return (f"the data's order is {other.describe()}, the run's {self.describe()}: "
                "another dataset, seed, shuffle setting or batch size names other records "
                "at the same position")  # fmt: skip

    def describe(self) -> str:
        shuffled = f"shuffled with seed {self.seed}" if self.shuffle else "not shuffled"
        return (f"{self.source!r} ({self.records} records, batches of {self.batch_size}, "
                f"{shuffled})")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DataOrder:
        """``ConfigError`` naming ``where`` unless ``data`` is an order's ``to_dict``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping) or set(data) != fields:
            raise ConfigError(f"{where}: expected {{{', '.join(sorted(fields))}}}, got "
                              f"{str(data)[:80]}")  # fmt: skip
        source, shuffle = data["source"], data["shuffle"]
        numbers = (data["records"], data["batch_size"], data["seed"])
        if not isinstance(source, str) or not isinstance(shuffle, bool) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in numbers
        ):
            raise ConfigError(f"{where}: an order's source is a string, shuffle a bool, "
                              f"the rest integers; got {str(data)[:80]}")  # fmt: skip
        records, batch_size, seed = numbers
        if not source.isprintable() or not 0 < len(source) <= MAX_SOURCE:
            raise ConfigError(f"{where}: an order's source is 1 to {MAX_SOURCE} printable "
                              f"characters, got {source[:80]!r}")  # fmt: skip
        if not (0 < records <= MAX_RECORDS and 0 < batch_size <= records and 0 <= seed < MAX_SEED):
            raise ConfigError(f"{where}: an order of {records} records in batches of "
                              f"{batch_size}, seed {seed}, is out of bounds")  # fmt: skip
        return cls(source, records, batch_size, seed, shuffle)


def hello_fields(source: str, records: int, seed: int, shuffle: bool) -> dict[str, Any]:
    """A hello's order fields (the batch size travels in the schema)."""
    return {"order_source": source, "order_records": records, "order_seed": seed,
            "order_shuffle": shuffle}  # fmt: skip


def order_of_hello(header: Mapping[str, Any], batch_size: int) -> DataOrder | None:
    """The order a hello names (with the schema's ``batch_size``), None if it names none;
    ``ConfigError`` if it is out of bounds (the hello is refused)."""
    if "order_source" not in header:
        return None
    return DataOrder.from_dict(
        {"source": header["order_source"], "records": header["order_records"],
         "batch_size": batch_size, "seed": header["order_seed"],
         "shuffle": header["order_shuffle"]},
        "the hello's order",
    )  # fmt: skip
