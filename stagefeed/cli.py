"""``stagefeed`` command line: produce, train, run (and the subcommands other modules add).

Imports stay light at module level: spawned producer processes re-import this module, and
they must never import TensorFlow.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from stagefeed import __version__, data_flags, envflags
from stagefeed.common.errors import BrokenError, ConfigError
from stagefeed.common.lifecycle import Shutdown
from stagefeed.common.logs import setup_logging
from stagefeed.common.options import (
    ON_NAN,
    TRANSPORTS,
    ObserveOptions,
    ProducerOptions,
    TrainerOptions,
)
from stagefeed.common.schema import Schema, image_schema, load_schema
from stagefeed.producer_flags import (
    add_connect_flags,
    add_producer_flags,
    add_shard_group_flag,
    endpoints,
)

log = logging.getLogger("stagefeed")


IMAGE_FLAGS = ("dtype", "image_size", "num_classes")
LOG_LEVELS = ("debug", "info", "warning", "error")
DTYPES = ("float32", "uint8")


def add_schema_flags(p: argparse.ArgumentParser, batch_size: int) -> None:
    g = p.add_argument_group(
        "batch",
        "What a batch is: --schema FILE|module:NAME, or the seed's images/labels schema shaped "
        "by --dtype, --image-size and --num-classes.",
    )
    envflags.add(g, "--schema", default=None, help="a .json/.toml schema file or module:NAME")
    envflags.add(g, "--batch-size", type=int, shown_default=str(batch_size), help="batch size")
    envflags.add(g, "--dtype", choices=DTYPES, shown_default="float32", help="the images' dtype")
    envflags.add(g, "--image-size", type=int, shown_default="227", help="image height and width")
    envflags.add(g, "--num-classes", type=int, shown_default="1000", help="labels are in [0, N)")
    p.set_defaults(default_batch_size=batch_size)


def schema_from(args: argparse.Namespace, required: bool = True) -> Schema | None:
    """The schema the flags describe; None for a producer given none (it adopts the trainer's)."""
    image_flags = [f for f in IMAGE_FLAGS if getattr(args, f) is not None]
    if args.schema is None and data_flags.is_data(args):
        return data_flags.data_schema(args, required)
    if args.schema is not None:
        if image_flags:
            flag = "--" + image_flags[0].replace("_", "-")
            raise ConfigError(f"{flag} shapes the default image schema; it cannot go with --schema")
        schema = load_schema(args.schema)
        return schema if args.batch_size is None else _resized(schema, args.batch_size)
    if not required and not image_flags and args.batch_size is None:
        return None
    return image_schema(
        batch_size=args.default_batch_size if args.batch_size is None else args.batch_size,
        image_size=227 if args.image_size is None else args.image_size,
        dtype=args.dtype or "float32",
        num_classes=1000 if args.num_classes is None else args.num_classes,
    )


def _resized(schema: Schema, batch_size: int) -> Schema:
    try:
        return schema.with_batch_size(batch_size)
    except ConfigError as exc:
        raise ConfigError(f"--batch-size: {exc}") from None


def add_trainer_flags(p: argparse.ArgumentParser, steps: int) -> None:
    g = p.add_argument_group("trainer")
    envflags.add(
        g, "--model", default="alexnet",
        help="alexnet, or module:NAME: a graph model_fn(staged, schema), or build(schema) "
        "returning a compiled Keras model (trained with model.fit); one that could be either: "
        "mark it @stagefeed.graph_model or @stagefeed.keras_model",
    )  # fmt: skip
    envflags.add(
        g, "--targets", default=None,
        help="Keras: comma-separated arrays fit gets as y (default: every array that is not "
        "a model input)",
    )  # fmt: skip
    envflags.add(
        g, "--enqueue-threads", type=int, default=2, old="--recv-threads",
        help="threads moving received batches into the queue",
    )  # fmt: skip
    envflags.add(
        g, "--steps", type=int, default=None, shown_default=str(steps),
        help="timed steps (0: until stopped or the data ends; not given, a source with "
        "passes runs its --epochs passes)",
    )  # fmt: skip
    envflags.add(g, "--warmup-steps", type=int, default=2, help="untimed steps before them")
    envflags.add(
        g, "--steps-per-epoch", type=int, default=0,
        help="an epoch's steps; the run is --epochs x this, warm-up included (replaces --steps)",
    )  # fmt: skip
    envflags.add(
        g, "--epochs", type=int, default=1,
        help="epochs: of --steps-per-epoch steps, or passes of sources with passes",
    )  # fmt: skip
    envflags.add(
        g, "--save", default=None, help="save what was trained here at the end: model.keras "
        "(Keras) or model.ckpt (graph); a DIR holding a run resumes it (docs/resume.md)",
    )  # fmt: skip
    envflags.add_switch(g, "--fresh", help="--save DIR holds a run: start over, not resume it")
    envflags.add(
        g, "--checkpoint-every", type=int, default=0,
        help="steps between checkpoints in --save DIR/checkpoints (0: none)",
    )  # fmt: skip
    envflags.add(
        g, "--on-nan", default="stop", choices=ON_NAN,
        help="a NaN or infinite loss: stop training (exit code 4) or warn and go on",
    )  # fmt: skip
    envflags.add_switch(
        g, "--require-full-run",
        help="exit 5 (after the summary) when the data ends before the planned steps/epochs",
    )  # fmt: skip
    envflags.add(g, "--queue-mb", type=float, default=2048.0, help="FIFOQueue budget in MiB")
    envflags.add(
        g, "--queue-batches", type=int, default=0,
        help="FIFOQueue depth in batches, within --queue-mb (0: 64, and no more than the "
        "planned steps)",
    )  # fmt: skip
    envflags.add(g, "--stage-depth", type=int, default=2, help="batches staged on the device")
    envflags.add(g, "--device", default="auto", choices=("auto", "cpu", "gpu"), help="train on")
    envflags.add(g, "--max-message-mb", type=float, default=0.0, help="0: one batch + 1 MiB")
    envflags.add(
        g, "--producer-timeout-s", type=float, default=10.0,
        help="a producer connection silent this long is forgotten: its credit returns, its "
        "shared-memory pool is unmapped (producers ping every 2 s while idle)",
    )  # fmt: skip
    envflags.add(
        g, "--cluster-join-timeout-s", type=float, default=120.0,
        help="under a TF_CONFIG cluster: how long a worker waits for every other to join (a "
        "chief that refused to start ends the others after this)",
    )  # fmt: skip
    envflags.add(g, "--json", default=None, help="write the summary as JSON to this path")
    envflags.add(g, "--progress-s", type=float, default=5.0, help="seconds between progress lines")
    envflags.add(g, "--wait-log-s", type=float, default=10.0, help="seconds between waiting lines")
    envflags.add(g, "--logdir", default=None, help="write TensorBoard scalars to this directory")
    envflags.add(
        g, "--metrics-port", type=int, default=None, help="serve Prometheus metrics (0: any port)"
    )
    envflags.add(
        g, "--metrics-bind", default="127.0.0.1",
        help="address the metrics endpoint listens on (0.0.0.0: every interface)",
    )  # fmt: skip
    envflags.add_switch(
        g, "--metrics-producer-labels", help="per-producer metrics, labelled with producer ids"
    )
    envflags.add(g, "--advice-s", type=float, default=300.0, help="seconds between advice lines")
    envflags.add(
        g, "--wire-mb-s", type=float, default=1400.0, help="MiB/s the producers' link carries"
    )
    envflags.add_switch(
        g, "--return-freed-memory", help="let glibc unmap freed batches (slower: page faults)"
    )
    p.set_defaults(default_steps=steps)
    envflags.add(
        g, "--shm-socket", default=None, shown_default="one per --bind address (run: its own)",
        help="where producers offer shared-memory pools",
    )  # fmt: skip
    envflags.add(
        g, "--shm-producers", type=int, default=None, shown_default="train 1, run --producers",
        help="same-host producers the shared-memory pools are sized for",
    )  # fmt: skip


def add_data_transport_flag(
    p: argparse.ArgumentParser, default: str = "zmq", deprecated: Sequence[str] = ()
) -> None:
    envflags.add(
        p, "--transport", default=default, choices=(*TRANSPORTS, *deprecated),
        metavar="{" + ",".join(TRANSPORTS) + "}",
        help="what carries batches: zmq (ZeroMQ frames), shm (shared-memory slots: same host "
        "and user) or auto (shm where it works, else zmq)",
    )  # fmt: skip


def add_common_flags(p: argparse.ArgumentParser) -> None:
    envflags.add(p, "--curve-keys", default=None, help="CURVE keys directory (stagefeed keygen)")
    envflags.add(p, "--log-level", default="info", choices=LOG_LEVELS, help="what the log shows")


def producer_options(
    args: argparse.Namespace, connect: str | tuple[str, ...], workers: int
) -> ProducerOptions:
    options = ProducerOptions(
        connect=connect,
        heartbeat_timeout_s=getattr(args, "heartbeat_timeout_s", 0.0),  # produce's flag
        shard_group=getattr(args, "shard_group", (0, 1)),  # produce's flag
        workers=workers,
        schema=schema_from(args, required=False),
        source=args.source,
        inflight_mb=args.inflight_mb,
        rate=args.rate,
        max_batches=args.max_batches,
        short_batch=args.short_batch,
        seed=args.seed,
        curve_keys=args.curve_keys,
        transport=args.transport,
        shuffle=args.shuffle,
        transform=args.transform,
        on_bad_record=args.on_bad_record,
    )
    data_flags.check_source(options)  # a built-in data source opens at start
    return options


def _steps(args: argparse.Namespace) -> int:
    """``--steps``, or the command's default; 0 (not used) with ``--steps-per-epoch``."""
    if not args.steps_per_epoch:  # --epochs > 1 alone: passes, as long as the data says
        if args.steps is None:
            return 0 if args.epochs > 1 else args.default_steps
        return args.steps
    if args.steps is not None:
        raise ConfigError(
            f"--steps {args.steps} with --steps-per-epoch {args.steps_per_epoch}: give one "
            "(the run is --epochs x --steps-per-epoch steps)"
        )
    return 0


def _targets(args: argparse.Namespace) -> tuple[str, ...] | None:
    if args.targets is None:
        return None
    names = tuple(name.strip() for name in args.targets.split(","))
    if not all(names):
        raise ConfigError(f"--targets {args.targets!r}: names separated by commas")
    return names


def trainer_options(args: argparse.Namespace, bind: str) -> TrainerOptions:
    return TrainerOptions(
        bind=bind,
        schema=schema_from(args),
        enqueue_threads=args.enqueue_threads,
        model=args.model,
        steps=_steps(args),
        warmup_steps=args.warmup_steps,
        queue_mb=args.queue_mb,
        queue_batches=args.queue_batches,
        stage_depth=args.stage_depth,
        device=args.device,
        max_message_mb=args.max_message_mb,
        producer_timeout_s=args.producer_timeout_s,
        wait_log_s=args.wait_log_s,
        cluster_join_s=args.cluster_join_timeout_s,
        curve_keys=args.curve_keys,
        keep_freed_memory=not args.return_freed_memory,
        transport=args.transport,
        shm_socket=args.shm_socket or _run_socket(args),
        shm_producers=args.shm_producers or getattr(args, "producers", 1),
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        length_by_passes=args.steps is None and not args.steps_per_epoch,
        save_dir=args.save, checkpoint_every=args.checkpoint_every, fresh=args.fresh,
        on_nan=args.on_nan,
        require_full_run=args.require_full_run,
        targets=_targets(args),
    )


def _run_socket(args: argparse.Namespace) -> str | None:
    """``run``'s own pool socket, in a private directory its trainer makes and removes."""
    if args.command != "run" or args.transport == "zmq":
        return None
    from stagefeed import loopback

    return loopback.pool_socket_path()


class _Parser(argparse.ArgumentParser):
    """argparse, with its own errors (a value of the wrong type, an unknown flag, a missing
    command) as the one line every bad flag gets: a ``ConfigError`` that ``main`` prints as
    ``stagefeed: error: ...`` with exit code 2, instead of the usage block. Subcommands'
    parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stagefeed",
        description="Feed a TensorFlow trainer from producer processes over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"stagefeed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("produce", help="start producer processes that push batches to a trainer")
    add_connect_flags(p)  # --connect (several), --connect-tf-config, heartbeats
    envflags.add(p, "--workers", type=int, default=1, help="producer processes")
    add_shard_group_flag(p)
    add_schema_flags(p, batch_size=256)
    add_producer_flags(p)
    add_data_transport_flag(p)
    add_common_flags(p)
    p.set_defaults(func=_produce)

    p = sub.add_parser("train", help="train a model on batches received from producers")
    envflags.add(p, "--bind", default="tcp://*:5555", help="address to listen on")
    add_schema_flags(p, batch_size=256)
    add_trainer_flags(p, steps=100)
    add_data_transport_flag(p)
    add_common_flags(p)
    p.set_defaults(func=_train, largest_block=_largest_array)

    from stagefeed import loopback  # no TensorFlow, no ZeroMQ

    p = sub.add_parser("run", help="trainer + N producers on this host: the main job")
    envflags.add(p, "--producers", type=int, default=2, help="producer processes")
    add_data_transport_flag(p, default="auto", deprecated=tuple(loopback.DEPRECATED_TRANSPORTS))
    envflags.add(
        p, "--bind", default=None, shown_default="a private ipc socket with shm, else "
        "tcp://127.0.0.1:*", help="address the trainer listens on",
    )  # fmt: skip
    add_schema_flags(p, batch_size=128)
    add_trainer_flags(p, steps=30)
    add_producer_flags(p)
    add_common_flags(p)
    p.set_defaults(func=_run, largest_block=_largest_array)

    from stagefeed import health  # its own module: the container healthcheck

    health.add_parser(sub)
    from stagefeed import keygen  # CURVE key pairs for --curve-keys

    keygen.add_parser(sub)
    from stagefeed.bench import cli as bench_cli  # no TensorFlow until a benchmark runs

    bench_cli.add_parser(sub)
    return parser


# Each command runs under a Shutdown installed first: from then on SIGINT and SIGTERM stop it
# and never raise; once it is over they are ignored while the interpreter exits.


def _produce(args: argparse.Namespace) -> int:
    shutdown = Shutdown().install()
    try:
        from stagefeed.launcher import produce

        connect = endpoints(args)
        return produce(producer_options(args, connect, args.workers), shutdown)
    finally:
        shutdown.finish()


def observe_options(args: argparse.Namespace) -> ObserveOptions:
    """Progress, advice, TensorBoard and Prometheus settings from the trainer flags."""
    return ObserveOptions(
        progress_s=args.progress_s,
        logdir=args.logdir,
        metrics_port=args.metrics_port,
        metrics_bind=args.metrics_bind,
        metrics_producer_labels=args.metrics_producer_labels,
        advice_s=args.advice_s,
        wire_mb_s=args.wire_mb_s,
    )


def _train(args: argparse.Namespace) -> int:
    shutdown = Shutdown().install()
    try:
        from stagefeed.launcher import train

        return train(trainer_options(args, args.bind), args.json, observe_options(args), shutdown)
    finally:
        shutdown.finish()


def _run(args: argparse.Namespace) -> int:
    shutdown = Shutdown().install()
    try:
        from stagefeed import loopback
        from stagefeed.launcher import LocalRun, run_local

        loopback.undeprecate(args)

        def flags(transport: str) -> argparse.Namespace:  # with the transport run decided
            return argparse.Namespace(**{**vars(args), "transport": transport})

        return run_local(LocalRun(
            lambda transport, bind: trainer_options(flags(transport), bind),
            lambda transport, to: producer_options(flags(transport), to, args.producers),
            observe_options(args), args.producers, args.transport, args.bind, args.shm_socket,
            args.json,
        ), shutdown)  # fmt: skip
    finally:
        shutdown.finish()


def keep_freed_memory_first(args: argparse.Namespace) -> None:
    """A trainer command whose batches need glibc's one-arena limit applies the trainer's
    malloc policy before any other thread starts (signal handling's, TensorFlow's): the limit
    holds only while the main arena is the only one (consumer/memory/malloc_policy.py); other
    batches get it when the trainer starts. ``args.largest_block``, set by the commands that
    train in this process, gives the largest array of their batches."""
    largest_block = getattr(args, "largest_block", None)
    if largest_block is None or getattr(args, "return_freed_memory", False):
        return
    from stagefeed.consumer.memory import malloc_policy  # no TensorFlow there

    largest = largest_block(args)
    if largest > malloc_policy.THREAD_HEAP_BYTES:
        malloc_policy.keep_freed_memory(largest)


def _largest_array(args: argparse.Namespace) -> int:
    return schema_from(args).largest_array_bytes  # type: ignore[union-attr]


def main(argv: Sequence[str] | None = None) -> int:
    # TensorFlow's C++ INFO/WARNING lines (oneDNN notices, cancelled enqueues at shutdown) would
    # bury stagefeed's own log; errors still show. Set TF_CPP_MIN_LOG_LEVEL to override.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        args = build_parser().parse_args(argv)
        envflags.check(args)
        setup_logging(getattr(logging, args.log_level.upper()))
        envflags.say_deprecated(args)
        keep_freed_memory_first(args)
        return args.func(args)
    except ConfigError as exc:
        print(f"stagefeed: error: {exc}", file=sys.stderr)
        return 2
    except BrokenError as exc:
        log.error("%s", exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
