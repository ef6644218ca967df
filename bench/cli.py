"""``stagefeed bench steps|cluster|ingest|input``: flags, then the run, then a table.

Imports stay light at module level (no TensorFlow): ``stagefeed.cli`` registers this parser
for every command, including the ones producer processes run. Flags are plain argparse (no
``STAGEFEED_*`` environment defaults) so a benchmark is reproducible from its command line.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from stagefeed.bench.config import (
    ALL_MODES,
    IMAGE_DTYPES,
    SHM_FILLS,
    TRANSPORTS,
    IngestConfig,
    StepsConfig,
    expand_modes,
)
from stagefeed.bench.input_config import INPUT_MODES, INPUT_TRANSPORTS, InputConfig
from stagefeed.common.errors import ClosedError, ConfigError
from stagefeed.common.schema import image_schema

log = logging.getLogger("stagefeed.bench")
STOPPED = 130  # exit status after Ctrl-C / SIGTERM, as a shell reports SIGINT


def _list_of(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, help="write every figure as JSON to this path")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help="train on")
    p.add_argument("--image-size", type=int, default=227, help="image height and width")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` and its subcommands on the ``stagefeed`` command line."""
    bench = subparsers.add_parser("bench", help="benchmarks: the seed's table, feed capacity")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    p = sub.add_parser("steps", help="ms/step of AlexNet for each input mode, in one run")
    p.add_argument(
        "--modes",
        type=_list_of(str),
        default=("graph",),
        help=f"comma-separated modes of {','.join(ALL_MODES)}, or families: graph (the "
        "first seven), keras (the keras-* trio), all [default: graph]",
    )
    p.add_argument("--batch-size", type=int, default=64, help="images per batch [64]")
    p.add_argument("--dtype", default="float32", choices=IMAGE_DTYPES, help="image dtype")
    p.add_argument("--steps", type=int, default=24, help="timed steps per mode [24]")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per mode [2]")
    p.add_argument(
        "--rounds", type=int, default=0, help="interleaved blocks per mode [0: one per step]"
    )
    p.add_argument("--producers", type=int, default=2, help="stagefeed producers [2]")
    p.add_argument(
        "--enqueue-threads", "--recv-threads", type=int, default=2,
        help="stagefeed enqueue threads [2] (--recv-threads: its old name)",
    )  # fmt: skip
    p.add_argument(
        "--transport", default="shm", choices=TRANSPORTS,
        help="stagefeed and keras-stagefeed's loopback [shm: what run uses on one host]; "
        "stagefeed-tcp is stagefeed over tcp whatever this says",
    )
    p.add_argument("--queue-mb", type=float, default=1024.0, help="queue budget, MiB [1024]")
    p.add_argument(
        "--seed-prestage", type=int, default=1, help="batches seed-staging stages first [1]"
    )
    _common(p)
    p.set_defaults(func=_steps)

    p = sub.add_parser(
        "cluster", help="ms/step of two trainer workers fed by stagefeed vs synthetic data"
    )
    p.add_argument("--batch-size", type=int, default=16, help="images per worker's batch [16]")
    p.add_argument("--image-size", type=int, default=195, help="image height and width [195]")
    p.add_argument("--steps", type=int, default=12, help="timed steps per mode [12]")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per mode [2]")
    p.add_argument("--producers", type=int, default=1, help="producers per worker [1]")
    p.add_argument("--json", default=None, help="write every figure as JSON to this path")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_cluster)

    p = sub.add_parser("ingest", help="GB/s the feed path delivers, next to raw pyzmq, memcpy")
    p.add_argument("--dtypes", type=_list_of(str), default=IMAGE_DTYPES, help="float32,uint8")
    p.add_argument("--producers", type=_list_of(int), default=(1, 2, 4), help="e.g. 1,2,4")
    p.add_argument("--transports", type=_list_of(str), default=TRANSPORTS, help="tcp,ipc,shm")
    p.add_argument(
        "--shm-fills",
        type=_list_of(str),
        default=SHM_FILLS,
        help="shm rows: producer copies into the slot, fills it in place [copy,inplace]",
    )
    p.add_argument("--batch-size", type=int, default=256, help="images per batch [256]")
    p.add_argument("--gb", type=float, default=3.0, help="GB moved per timed measurement [3]")
    p.add_argument("--repeats", type=int, default=3, help="measurements per peer; median [3]")
    _common(p)
    # The trainer runs in this process: the command line applies its malloc policy first.
    p.set_defaults(func=_ingest, largest_block=_largest_images)

    p = sub.add_parser(
        "input", help="images/s of a decode-bound pipeline: stagefeed vs tf.data and PyDataset"
    )
    p.add_argument("--producers", type=_list_of(int), default=(1, 2), help="N values [1,2]")
    p.add_argument("--images", type=int, default=256, help="JPEG files written at start [256]")
    p.add_argument("--image-size", type=int, default=256, help="their height and width [256]")
    p.add_argument("--crop", type=int, default=224, help="random crop's height and width [224]")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch [32]")
    p.add_argument("--steps", type=int, default=100, help="timed steps per mode [100]")
    p.add_argument("--warmup-steps", type=int, default=10, help="untimed steps per mode [10]")
    p.add_argument(
        "--modes", type=_list_of(str), default=INPUT_MODES,
        help=f"comma-separated subset of {','.join(INPUT_MODES)} [all]",
    )  # fmt: skip
    p.add_argument(
        "--transports", type=_list_of(str), default=INPUT_TRANSPORTS,
        help="stagefeed's: shm (what run uses on one host), tcp [shm,tcp]",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="images, order and crops [0]")
    p.add_argument("--json", default=None, help="write every figure as JSON to this path")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=_input)


def _steps(args: argparse.Namespace) -> int:
    try:
        from stagefeed.bench.steps import run_steps
    except ImportError as exc:
        if exc.name != "psutil":
            raise
        raise ConfigError(str(exc)) from exc  # bench.cpu's message: what to install
    from stagefeed.bench.table import steps_table

    config = StepsConfig(
        modes=expand_modes(tuple(args.modes)),
        schema=image_schema(
            batch_size=args.batch_size, image_size=args.image_size, dtype=args.dtype
        ),
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        rounds=args.rounds,
        producers=args.producers,
        enqueue_threads=args.enqueue_threads,
        transport=args.transport,
        queue_mb=args.queue_mb,
        seed_prestage=args.seed_prestage,
        device=args.device,
    )
    return _run_and_report(
        "steps", lambda: run_steps(config, logging.getLogger().level), steps_table, args.json
    )


def _cluster(args: argparse.Namespace) -> int:
    for name in ("batch_size", "image_size", "steps", "producers"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    from stagefeed.bench.cluster import cluster_table, run_cluster

    return _run_and_report(
        "cluster",
        lambda: run_cluster(
            args.batch_size, args.image_size, args.steps, args.warmup_steps, args.producers
        ),
        cluster_table,
        args.json,
    )


def _largest_images(args: argparse.Namespace) -> int:
    """The largest array ``bench ingest`` will feed: the images of its widest dtype."""
    return max(
        image_schema(args.batch_size, args.image_size, dtype=dtype).largest_array_bytes
        for dtype in args.dtypes
    )


def _ingest(args: argparse.Namespace) -> int:
    config = IngestConfig(
        dtypes=tuple(args.dtypes),
        producers=tuple(args.producers),
        transports=tuple(args.transports),
        shm_fills=tuple(args.shm_fills),
        batch_size=args.batch_size,
        image_size=args.image_size,
        gb=args.gb,
        repeats=args.repeats,
        device=args.device,
    )  # a bad value is a ConfigError here, before TensorFlow loads
    from stagefeed.consumer.quiet_tf import import_tensorflow

    import_tensorflow()  # before bench.ingest imports it: its start-up lines filtered
    from stagefeed.bench.ingest import run_ingest
    from stagefeed.bench.table import ingest_table

    return _run_and_report(
        "ingest", lambda: run_ingest(config, logging.getLogger().level), ingest_table, args.json
    )


def _input(args: argparse.Namespace) -> int:
    config = InputConfig(
        producers=tuple(args.producers),
        images=args.images,
        image_size=args.image_size,
        crop=args.crop,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        modes=tuple(args.modes),
        transports=tuple(args.transports),
        seed=args.seed,
    )  # a bad value is a ConfigError here, before any file is written
    try:
        from stagefeed.bench.input import run_input
    except ImportError as exc:
        if exc.name != "psutil":
            raise
        raise ConfigError(str(exc)) from exc  # bench.cpu's message: what to install
    from stagefeed.bench.input_table import input_table

    return _run_and_report(
        "input", lambda: run_input(config, logging.getLogger().level), input_table, args.json
    )


def _run_and_report(
    name: str,
    run: Callable[[], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    json_path: str | None,
) -> int:
    """Run one benchmark, print its table, write its JSON; STOPPED if a signal ended it."""
    from stagefeed.bench.report import write_json

    try:
        report = run()
    except ClosedError:
        log.warning("bench %s stopped before it finished: nothing to report", name)
        return STOPPED
    print(table(report), flush=True)
    if json_path:
        write_json(report, json_path)
    return 0
