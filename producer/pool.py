"""A supervised group of producer processes (``stagefeed produce --workers N``)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from typing import Protocol

from stagefeed.common.errors import BrokenError
from stagefeed.common.lifecycle import STOP_SIGNALS, stop_processes
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.process_pipes import FailureReports, StopFlag
from stagefeed.producer.worker import worker_main

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 4.0


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread, and so in the processes it starts.

    A spawned worker inherits the mask and unblocks the signals once its own handlers are in
    place: a Ctrl-C to the process group while it imports would otherwise end it with a
    ``KeyboardInterrupt`` traceback. Signals to this process are not lost meanwhile: the kernel
    hands them to another thread, or delivers them when the mask is lifted.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class ProducerPool:
    """Starts ``options.workers`` named producer processes with the spawn context.

    Lifecycle: ``start()`` once, then ``wait()`` and/or ``close()``. ``close()`` is idempotent:
    it sets the shared stop event, joins within ``STOP_TIMEOUT_S`` (cut short when ``hurry()``
    turns true), then terminates and kills.

    A worker *failed* when it exited non-zero by itself. Workers stopped by the flag or by a
    signal exit 0, so any other exit code is a failure, before or after ``close()``; only the
    exit codes of workers that ``close()`` had to terminate or kill are ours.
    """

    def __init__(self, options: ProducerOptions, log_level: int = logging.INFO) -> None:
        self.options = options
        self._ctx = multiprocessing.get_context("spawn")
        # Pipes, not multiprocessing's Event/Queue: nothing in /dev/shm survives a SIGKILL.
        self._stop = StopFlag(self._ctx)
        self._failures = FailureReports(self._ctx)
        self._log_level = log_level
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._forced: set[int] = set()  # id() of the processes close() terminated or killed
        self._closed = False

    def start(self) -> ProducerPool:
        # The tracker unblocks SIGINT and SIGTERM in this thread when it starts: start it first.
        resource_tracker.ensure_running()
        with _stop_signals_blocked():
            for index in range(self.options.workers):
                proc = self._ctx.Process(
                    target=worker_main,
                    args=(self.options, index, self._stop, self._log_level, self._failures),
                    name=f"stagefeed-producer-{index}",
                    daemon=True,
                )
                proc.start()
                self.processes.append(proc)
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every worker to end by itself; True if all ended. Raise if one failed."""
        for proc in self.processes:
            proc.join(timeout_s)
        done = all(not p.is_alive() for p in self.processes)
        self._raise_failures()
        return done

    def alive(self) -> int:
        return sum(p.is_alive() for p in self.processes)

    def close(self, hurry: Callable[[], bool] | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        forced = stop_processes(self.processes, STOP_TIMEOUT_S, hurry)
        self._forced.update(id(p) for p in forced)

    def failures(self) -> list[str]:
        """``name (exit N)`` of every worker that failed (see the class docstring)."""
        return [
            f"{p.name} (exit {p.exitcode})"
            for p in self.processes
            if p.exitcode not in (None, 0) and id(p) not in self._forced
        ]

    def _raise_failures(self) -> None:
        reported = self._failures.first()  # a worker's own one-line ConfigError/BrokenError
        if reported is not None:
            raise reported
        failed = self.failures()
        if failed:
            raise BrokenError(f"producer processes failed: {', '.join(failed)}")

    def __enter__(self) -> ProducerPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pool(Protocol):
    """What the check needs of a ``ProducerPool``."""

    def alive(self) -> int: ...

    def wait(self, timeout_s: float | None = None) -> bool: ...


def pool_check(pool: _Pool, ended: type[Exception] = BrokenError) -> Callable[[], None]:
    """A ``health_check`` that raises once no process of ``pool`` is alive.

    A producer that failed (non-zero exit) raises ``BrokenError`` naming it, from
    ``pool.wait(0)``. If every producer ended cleanly, ``ended("all producers ended")``:
    ``BrokenError`` where producers are meant to run until stopped (the benchmarks), or
    ``ClosedError`` where they may finish first (``stagefeed run --max-batches``: the launcher).
    While any producer is alive the check costs one ``is_alive()`` per process.
    """

    def check() -> None:
        if not pool.alive():
            pool.wait(0)  # raises BrokenError if any failed
            raise ended("all producers ended")

    return check
