"""What ``stagefeed produce``, ``train`` and ``run`` do: start, supervise, stop, summarize."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stagefeed.common.errors import ClosedError
from stagefeed.common.lifecycle import on_stop_signals
from stagefeed.common.options import ProducerOptions, TrainerOptions
from stagefeed.producer.pool import ProducerPool

if TYPE_CHECKING:
    from stagefeed.consumer.monitor import ObserveOptions

log = logging.getLogger("stagefeed")


def produce(options: ProducerOptions) -> int:
    """Run producer processes until they finish (``--max-batches``) or a signal stops them."""
    _check_client_keys(options)
    stop = threading.Event()
    restore = on_stop_signals(lambda _sig: stop.set())
    pool = ProducerPool(options, logging.getLogger().level).start()
    try:
        while not stop.is_set() and pool.alive():
            pool.wait(0.2)
    finally:
        pool.close()
        restore()
    pool.wait(0)
    return 0


def _check_client_keys(options: ProducerOptions) -> None:
    """Fail at start, naming the file, if the producers' CURVE keys are unusable."""
    if options.curve_keys:
        from stagefeed.common.curve import client_configurator

        client_configurator(options.curve_keys)


def _server_configurator(options: TrainerOptions) -> Callable[[Any], None] | None:
    if not options.curve_keys:
        return None
    from stagefeed.common.curve import server_configurator

    return server_configurator(options.curve_keys)


def observe_options(args: argparse.Namespace) -> ObserveOptions:
    """Progress, advice, TensorBoard and Prometheus settings from the trainer flags."""
    from stagefeed.consumer.monitor import ObserveOptions

    return ObserveOptions(
        progress_s=args.progress_s,
        logdir=args.logdir,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        advice_s=args.advice_s,
        wire_mb_s=args.wire_mb_s,
    )


def _finish(
    trainer: Any,
    started: float,
    stop: threading.Event,
    json_path: str | None,
    final: dict[str, Any] | None = None,
) -> None:
    from stagefeed.consumer.summary import format_text, summarize, write_json

    summary = summarize(trainer, time.monotonic() - started, interrupted=stop.is_set())
    summary.update(final or {})  # "advice" and "bottleneck" from the Monitor
    print(format_text(summary), flush=True)
    if json_path:
        write_json(summary, json_path)
        log.info("summary written to %s", json_path)


def train(options: TrainerOptions, json_path: str | None, observe: ObserveOptions) -> int:
    """Listen, train ``options.steps`` steps (or until a signal), print the summary."""
    from stagefeed.consumer.monitor import Monitor
    from stagefeed.consumer.trainer import Trainer

    stop = threading.Event()
    restore = on_stop_signals(lambda _sig: stop.set())
    monitor = Monitor(observe)
    trainer = Trainer(options, [monitor], _server_configurator(options))
    started = time.monotonic()
    try:
        monitor.start(trainer)
        trainer.start()
        try:
            trainer.train(stop)
        except ClosedError:
            log.info("stopped before training started")
    finally:
        try:
            monitor.close()
        finally:
            trainer.close()
            restore()
    _finish(trainer, started, stop, json_path, monitor.final)
    return 0


def run_local(
    args: argparse.Namespace,
    trainer_options: Callable[[argparse.Namespace, str], TrainerOptions],
    producer_options: Callable[[argparse.Namespace, str, int], ProducerOptions],
) -> int:
    """The main job: a trainer and ``--producers`` producer processes on loopback."""
    from stagefeed.consumer.monitor import Monitor
    from stagefeed.consumer.trainer import Trainer

    ipc_path = None
    if args.transport in ("ipc", "shm", "auto"):  # shared memory: control over ipc
        ipc_path = os.path.join(tempfile.gettempdir(), f"stagefeed-{os.getpid()}.sock")
        bind = f"ipc://{ipc_path}"
    else:
        bind = "tcp://127.0.0.1:*"
    options = trainer_options(args, bind)
    # Validate the producers' options before anything starts (endpoint filled in below).
    _check_client_keys(producer_options(args, "tcp://127.0.0.1:1", args.producers))
    monitor = Monitor(observe_options(args))
    stop = threading.Event()
    restore = on_stop_signals(lambda _sig: stop.set())
    trainer = Trainer(options, [monitor], _server_configurator(options))
    pool: ProducerPool | None = None
    started = time.monotonic()
    try:
        monitor.start(trainer)
        trainer.start()
        pool = ProducerPool(
            producer_options(args, trainer.endpoint, args.producers), logging.getLogger().level
        ).start()
        log.info("%d producers -> %s", args.producers, trainer.endpoint)
        try:
            trainer.train(stop, health_check=_pool_check(pool))
        except ClosedError:
            log.info("stopped before training started")
    finally:
        try:
            monitor.close()
        finally:
            if pool is not None:
                pool.close()
            trainer.close()
            restore()
            if ipc_path and os.path.exists(ipc_path):
                os.unlink(ipc_path)
    _finish(trainer, started, stop, args.json, monitor.final)
    sys.stdout.flush()
    return 0


def _pool_check(pool: ProducerPool) -> Callable[[], None]:
    def check() -> None:
        if not pool.alive():
            pool.wait(0)  # raises BrokenError if any failed
            raise ClosedError("all producers ended")

    return check
