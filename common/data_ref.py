"""``--source KIND:PATH[,PATH...]``: the built-in data sources named on the command line.

Parsed here, below both sides, so that ``ProducerOptions`` can check a source at
construction and the command line can derive a schema from the data; the readers themselves
live in ``stagefeed.producer.data``. A kind's name takes precedence over a user module of the
same name: ``--source npy:train.npy`` is always the ``.npy`` reader.
"""

from __future__ import annotations

import dataclasses

from stagefeed.common.errors import ConfigError

# npy: one or more .npy files, one array each (named by the file's stem), memory-mapped;
# npz: one uncompressed .npz, its members memory-mapped; images: a folder of class folders;
# parquet: Parquet files (or folders of them), read by row group.
DATA_KINDS = ("npy", "npz", "images", "parquet")
ON_BAD_RECORD = ("fail", "skip")


@dataclasses.dataclass(frozen=True)
class DataRef:
    """A parsed ``KIND:PATH[,PATH...]``."""

    kind: str
    paths: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(self.paths)}"


def parse_data_ref(text: str) -> DataRef | None:
    """The ``DataRef`` that ``text`` names, or None when it names no built-in kind (then it
    is ``synthetic`` or ``module:function``). ``ConfigError`` for a kind with no path."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in DATA_KINDS:
        return None
    paths = tuple(p.strip() for p in rest.split(","))
    if not all(paths):
        raise ConfigError(f"--source {text!r}: expected {kind}:PATH[,PATH...], an empty path")
    return DataRef(kind, paths)
