"""The built-in sources by name: ``--source npy:PATH[,PATH]``, ``npz:PATH``, ``images:DIR``,
``parquet:PATH[,PATH]`` (``common.data_ref``), made into a ``MapSource`` with the
producer's ``--shuffle``, ``--seed``, ``--transform``, ``--on-bad-record`` and
``--short-batch``.
"""

from __future__ import annotations

from stagefeed.common.data_ref import DataRef, parse_data_ref
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.data.records import Records
from stagefeed.producer.data.source import MapSource


def open_records(ref: DataRef, image_size: tuple[int, int] | None = None) -> Records:
    """The records ``ref`` names (images decoded at ``image_size``, or the first image's);
    ``ConfigError`` in one line for a missing path, an empty folder, an unreadable file."""
    if ref.kind == "npy":
        from stagefeed.producer.data.arrays import open_npy

        return open_npy(ref.paths)
    if ref.kind == "npz":
        from stagefeed.producer.data.npz import open_npz

        if len(ref.paths) != 1:
            raise ConfigError(f"--source {ref}: one .npz file")
        return open_npz(ref.paths[0])
    if ref.kind == "images":
        from stagefeed.producer.data.images import ImageFolder

        if len(ref.paths) != 1:
            raise ConfigError(f"--source {ref}: one folder of class folders")
        return ImageFolder(ref.paths[0], image_size)
    from stagefeed.producer.data.parquet import ParquetRecords

    return ParquetRecords(ref.paths)


def data_source(options: ProducerOptions) -> MapSource | None:
    """The ``MapSource`` that ``options.source`` names, or None when it names no built-in
    data source (``synthetic``, ``module:function``)."""
    ref = parse_data_ref(options.source)
    if ref is None:
        return None
    return MapSource(
        open_records(ref),
        shuffle=options.shuffle,
        seed=options.seed,
        transform=options.transform,
        on_bad_record=options.on_bad_record,
        short_batch=options.short_batch,
        name=str(ref),
    )
