"""The built-in data sources' flags (docs/data.md): ``--shuffle/--no-shuffle``,
``--transform module:function``, ``--on-bad-record fail|skip``, and the schema a
``--source KIND:PATH`` derives from its data when no ``--schema`` is given.

What is derived: one array per field of a record, named, typed and shaped as the data is
(``npy``: per file, named by its stem; ``npz``: per member; ``parquet``: per column of
numbers or of lists of numbers; ``images``: ``images`` uint8[H, W, 3], cast to float32 and
scaled by 1/255 on the device, at ``--image-size`` or the first image's size, and int32
``labels`` bounded by the number of class folders); with ``--transform``, what the transform
makes of record 0. ``--batch-size`` is the command's. Integer arrays get no bounds (a
``--schema`` file can add them), ``images`` labels excepted.
"""

from __future__ import annotations

import argparse
import os

from stagefeed import envflags
from stagefeed.common.data_ref import DATA_KINDS, ON_BAD_RECORD, parse_data_ref
from stagefeed.common.errors import ConfigError
from stagefeed.common.options import ProducerOptions
from stagefeed.common.schema import Schema

_CACHE = "data_schema_cache"
SHUFFLE_ENV = envflags.env_name("--shuffle")


def add_data_flags(g: argparse._ArgumentGroup) -> None:
    raw = os.environ.get(SHUFFLE_ENV, "").strip().lower()
    if raw not in ("", "0", "1", "true", "false", "yes", "no"):
        envflags._defer(g, f"{SHUFFLE_ENV}={raw!r} must be 1/0, true/false or yes/no")
    g.add_argument(
        "--shuffle", action=argparse.BooleanOptionalAction,
        default=raw not in ("0", "false", "no"),
        help=f"{'|'.join(DATA_KINDS)}:PATH sources: each epoch in an order drawn from "
        f"(--seed, epoch), or in file order [env {SHUFFLE_ENV}; default: on]",
    )  # fmt: skip
    envflags.add(
        g, "--transform", default=None,
        help="module:function(record, rng) run on each record in the producer, rng seeded "
        "from (--seed, epoch, record) (built-in data sources)",
    )  # fmt: skip
    envflags.add(
        g, "--on-bad-record", default="fail", choices=ON_BAD_RECORD,
        help="an undecodable or ill-shaped record of a built-in data source: end in one line "
        "naming it (exit 2), or skip it (counted, logged, named in the producer's last line)",
    )  # fmt: skip


def is_data(args: argparse.Namespace) -> bool:
    """Whether the command's ``--source`` names a built-in data source."""
    source = getattr(args, "source", None)
    return isinstance(source, str) and parse_data_ref(source) is not None


def data_schema(args: argparse.Namespace, required: bool) -> Schema | None:
    """The schema of ``--source KIND:PATH``'s data (see the module docstring); None for a
    producer given no batch flags (it adopts the trainer's, and its records must fit it)."""
    for flag in ("dtype", "num_classes"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} shapes the default image schema; with "
                              f"--source {args.source} the schema comes from the data")  # fmt: skip
    ref = parse_data_ref(args.source)
    assert ref is not None
    if args.image_size is not None and ref.kind != "images":
        raise ConfigError(f"--image-size sizes images: not with --source {args.source}")
    if not required and args.batch_size is None and args.image_size is None:
        return None
    batch_size = args.default_batch_size if args.batch_size is None else args.batch_size
    cache = getattr(args, _CACHE, None)
    if cache is None or cache[0] != batch_size:
        from stagefeed.producer.data.derive import derive_schema  # opens the data

        size = None if args.image_size is None else (args.image_size, args.image_size)
        schema = derive_schema(ref, batch_size, args.seed, args.transform, size)
        setattr(args, _CACHE, (batch_size, schema))
        return schema
    return cache[1]


def check_source(options: ProducerOptions) -> None:
    """Open ``options.source``'s data at start, when it is a built-in data source: a missing
    path, an empty folder, a column the schema names and the file lacks, or records that
    make no batch fail here, in one line (exit 2), before any producer starts."""
    if parse_data_ref(options.source) is None:
        return
    from stagefeed.producer.data.named import data_source

    source = data_source(options)
    if source is not None and options.schema is not None:
        source.check(options.schema)
        source.sampler(options.schema.batch_size)
