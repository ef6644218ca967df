"""What ``stagefeed produce``, ``train`` and ``run`` do: start, supervise, stop, summarize.

Every command runs under a ``Shutdown`` (``common.lifecycle``), installed before anything slow
starts (TensorFlow's import included): the first SIGINT/SIGTERM stops the command, a later one
(or one that arrives while the command is ending by itself) makes the shutdown urgent, and no
signal ever raises. Options and output paths are checked before TensorFlow is imported or any
process starts; a signal during start-up skips whatever has not started yet. The shutdown
closes everything whatever happened, then the summary is written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stagefeed import loopback
from stagefeed.common import tf_config
from stagefeed.common.errors import (
    EXIT_BROKEN,
    EXIT_CONFIG,
    EXIT_NON_FINITE,
    EXIT_SHORT_RUN,
    BrokenError,
    ClosedError,
    ConfigError,
    NonFiniteLoss,
    StagefeedError,
)
from stagefeed.common.ipc_file import sweep_leftovers
from stagefeed.common.lifecycle import Shutdown, end_process, exit_if_threads_left
from stagefeed.common.options import ObserveOptions, ProducerOptions, TrainerOptions
from stagefeed.common.paths import check_writable_dir, check_writable_file
from stagefeed.producer.pool import Producers

if TYPE_CHECKING:
    from stagefeed.consumer.observe.monitor import FinalFigures, Monitor
    from stagefeed.consumer.trainer_base import TrainerBase

log = logging.getLogger("stagefeed")

POLL_S = 0.2
# After the shutdown, how long a non-daemon thread that outlived its join may keep the process.
LEFTOVER_THREADS_S = 2.0


def produce(options: ProducerOptions, shutdown: Shutdown | None = None) -> int:
    """Run producer processes (``stagefeed.Producers``) until they finish (``--max-batches``,
    the data's end) or a signal stops them; a worker's failure is raised as it reported it."""
    shutdown = shutdown or Shutdown().install()
    producers = Producers(options, logging.getLogger().level)
    try:
        if not shutdown.stop.is_set():
            producers.start()
        # wait() raises a worker's failure as soon as it is reported (exit 2 or 3)
        while not producers.wait(POLL_S) and not shutdown.stop.is_set():
            pass
    finally:
        shutdown.begin()
        producers.close(hurry=shutdown.urgent.is_set)
    producers.wait(0)  # a worker that failed, even during the shutdown, is reported
    return 0


def _check_client_keys(options: ProducerOptions) -> None:
    """Fail at start, naming the file, if the producers' CURVE keys are unusable."""
    if options.curve_keys:
        from stagefeed.common.curve import client_configurator

        client_configurator(options.curve_keys)


def _check_outputs(json_path: str | None, logdir: str | None, options: TrainerOptions) -> None:
    """Every path the trainer will write, tried now: not after an hour of training; and the
    checkpoint ``--save`` resumes from, checked (a mismatch is refused before TensorFlow)."""
    if json_path:
        check_writable_file("--json", json_path)
    if logdir:
        check_writable_dir("--logdir", logdir)
    if options.save_dir:
        from stagefeed.consumer.checkpoints import check_save_dir  # no TensorFlow there

        check_writable_dir("--save", options.save_dir)
        check_save_dir(options)


def _server_configurator(options: TrainerOptions) -> Callable[[Any], None] | None:
    if not options.curve_keys:
        return None
    from stagefeed.common.curve import server_configurator

    return server_configurator(options.curve_keys)


def _start(monitor: Monitor, trainer: TrainerBase, shutdown: Shutdown) -> bool:
    """Start the monitor, then the trainer, unless a stop came first; True if both started."""
    for step in (lambda: monitor.start(trainer.facts, trainer.reader), trainer.start):
        if shutdown.stop.is_set():
            log.info("stopped during start-up")
            return False
        step()
    return True


def _train(
    trainer: TrainerBase, shutdown: Shutdown, health_check: Callable[[], None] | None = None
) -> StagefeedError | None:
    """Train until done or stopped; a failure (receive thread, producers, a producer's source
    that failed (``ConfigError``), a non-finite loss) is returned, so that the shutdown and
    the summary still happen."""
    try:
        trainer.train(shutdown.stop, health_check=health_check)
    except ClosedError as exc:
        log.info("stopped before training started: %s", exc)
    except (BrokenError, ConfigError, NonFiniteLoss) as exc:
        return exc
    return None


def _close(
    shutdown: Shutdown, monitor: Monitor, trainer: TrainerBase, pool: Producers | None = None
) -> None:
    """Close everything, each step whatever the one before did: the trainer before the
    producers, so that its closing intake lets them go (the ``saved`` of its final checkpoint,
    a finished run's ``bye``) before they are stopped."""
    shutdown.begin()  # from here on, a signal cuts the grace periods
    try:
        monitor.close()
    finally:
        try:
            trainer.close()
        finally:
            if pool is not None:
                pool.close(hurry=shutdown.urgent.is_set)


def _finish(
    trainer: TrainerBase,
    started: float,
    shutdown: Shutdown,
    json_path: str | None,
    final: FinalFigures | None,
    failure: StagefeedError | None,
    transport_choice: dict[str, str] | None = None,
) -> int:
    """Print and write the summary; the exit code: 2 if a producer's source failed (its one
    line is the last on stderr), 4 if a non-finite loss stopped training, 3 if something else
    failed, 5 if the data ended before the planned steps under ``require_full_run``, 1 if the
    JSON could not be written after all (the text summary is on stdout), else 0."""
    from stagefeed.consumer.observe.summary import format_text, summarize, write_json

    summary = summarize(
        trainer.report(), final, time.monotonic() - started, shutdown.by_signal, transport_choice
    )
    print(format_text(summary), flush=True)
    code = 0
    if json_path:
        try:
            write_json(summary, json_path)
            log.info("summary written to %s", json_path)
        except OSError as exc:
            log.error("cannot write the summary to %s: %s", json_path, exc)
            code = 1
    short = summary["run_length"]["short_because"]
    if isinstance(failure, ConfigError):
        print(f"stagefeed: error: {failure}", file=sys.stderr, flush=True)  # as cli.main does
        code = EXIT_CONFIG
    elif failure is not None:
        log.error("%s", failure)
        code = EXIT_NON_FINITE if isinstance(failure, NonFiniteLoss) else EXIT_BROKEN
    elif short and trainer.options.require_full_run:
        log.error("--require-full-run: %s before the planned steps", short)
        code = EXIT_SHORT_RUN
    elif short:
        log.warning("%s before the planned steps (see the summary)", short)
    return code


def train(
    options: TrainerOptions,
    json_path: str | None,
    observe: ObserveOptions,
    shutdown: Shutdown | None = None,
) -> int:
    """Listen, train ``options.total_steps`` steps (or until a signal), print the summary."""
    shutdown = shutdown or Shutdown().install()
    _check_outputs(json_path, observe.logdir, options)
    # TF_CONFIG, checked or derived, before TensorFlow reads it: the trainer's place, read once.
    place = tf_config.ClusterPlace.of(tf_config.apply_indexed_job())
    # TensorFlow loads here (seconds): a signal meanwhile takes effect once it has loaded.
    from stagefeed.consumer.quiet_tf import import_tensorflow

    import_tensorflow()
    from stagefeed.consumer import trainers
    from stagefeed.consumer.observe.monitor import Monitor

    monitor = Monitor(observe)
    trainer = trainers.trainer(options, [monitor], _server_configurator(options), place=place)
    started = time.monotonic()
    failure: StagefeedError | None = None
    try:
        if _start(monitor, trainer, shutdown):
            failure = _train(trainer, shutdown)
    finally:
        _close(shutdown, monitor, trainer)
    code = _finish(trainer, started, shutdown, json_path, monitor.final, failure)
    exit_if_threads_left(code, shutdown.grace(LEFTOVER_THREADS_S))
    if trainer.exit_without_teardown:
        end_process(code)
    return code


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """What ``run_local`` is given: the options the command line made, as two builders of the
    transport ``run`` decides on its host (``loopback.plan``), since the trainer's bind and the
    producers' endpoint follow from it. ``trainer_options(transport, bind)`` and
    ``producer_options(transport, endpoint)`` raise ``ConfigError`` for a bad flag."""

    trainer_options: Callable[[str, str], TrainerOptions]
    producer_options: Callable[[str, str], ProducerOptions]
    observe: ObserveOptions
    producers: int
    transport: str  # as asked: auto, zmq or shm
    bind: str | None
    shm_socket: str | None
    json_path: str | None


def run_local(run: LocalRun, shutdown: Shutdown | None = None) -> int:
    """The main job: a trainer and ``run.producers`` producer processes on loopback."""
    shutdown = shutdown or Shutdown().install()
    # Every flag checked first (ZeroMQ on a provisional address), then --transport decided.
    checked = run.trainer_options("zmq", "tcp://127.0.0.1:*")
    observe = run.observe
    _check_outputs(run.json_path, observe.logdir, checked)  # --save resumable, before the plan
    loop = loopback.plan(run.transport, run.bind, checked, run.producers, run.shm_socket)
    options = run.trainer_options(loop.transport, loop.bind)
    private_ipc = loopback.ipc_path()  # run's own socket file: removed whatever happens
    # Validate the producers' options before anything starts (endpoint filled in below).
    _check_client_keys(run.producer_options(loop.transport, "tcp://127.0.0.1:1"))
    sweep_leftovers()  # what killed runs left in the temp directory under run's own names
    if loop.asked == "auto":  # after every check: a refused start says one line only
        log.info("--transport auto: %s (%s)", loop.chosen, loop.reason)
    place = tf_config.place()  # the trainer's place in a TF_CONFIG cluster, read once
    from stagefeed.consumer.quiet_tf import import_tensorflow

    import_tensorflow()  # seconds
    from stagefeed.consumer import trainers
    from stagefeed.consumer.observe.monitor import Monitor

    monitor = Monitor(observe)
    trainer = trainers.trainer(options, [monitor], _server_configurator(options), place=place)
    pool: Producers | None = None
    failure: StagefeedError | None = None
    started = time.monotonic()
    try:
        if _start(monitor, trainer, shutdown) and not shutdown.stop.is_set():
            pool = Producers(
                run.producer_options(loop.transport, trainer.endpoint), logging.getLogger().level
            ).start()
            log.info("%d producers -> %s", run.producers, trainer.endpoint)
            # Workers that said end (a finished or failed source) leave the end of the data to
            # the trainer, which trains what they delivered first; a failure is reported after.
            check = pool.health_check(ClosedError, ends_grace_s=options.producer_timeout_s)
            failure = _train(trainer, shutdown, health_check=check)
    finally:
        try:
            _close(shutdown, monitor, trainer, pool)
        finally:
            if loop.bind == f"ipc://{private_ipc}" and os.path.exists(private_ipc):
                os.unlink(private_ipc)
    if failure is None and pool is not None and pool.failures():
        try:  # what a failed worker reported, as it reported it (a source's ConfigError: 2)
            pool.wait(0)
        except (BrokenError, ConfigError) as exc:
            failure = exc
        if failure is None:
            failure = BrokenError(f"producer processes failed: {', '.join(pool.failures())}")
    code = _finish(
        trainer, started, shutdown, run.json_path, monitor.final, failure, loop.summary()
    )
    sys.stdout.flush()
    exit_if_threads_left(code, shutdown.grace(LEFTOVER_THREADS_S))
    return code
