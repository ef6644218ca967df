"""Producer processes that push batches to a trainer: ``stagefeed.Producers``, what
``stagefeed produce --workers N`` runs, and what a notebook or a test starts in Python."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing import resource_tracker
from typing import Protocol

from stagefeed.common.errors import BrokenError, ClosedError
from stagefeed.common.lifecycle import STOP_SIGNALS, stop_processes
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.process_pipes import StopFlag, WorkerReports
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


@dataclasses.dataclass(frozen=True)
class WorkerBook:
    """What one producer process reported of itself (``Producers.books()``).

    ``state``: ``running``; ``finished`` (its data ended or ``max_batches``: it sent what it
    held and said ``end``, unless no credit came within 30 s: then ``bye`` is None);
    ``stopped`` (by ``close()`` or a signal: what it held was discarded); ``failed`` (it
    exited with ``error``: a source error, after it delivered what it made, or the trainer
    refused it); ``killed`` (it ended without a report: killed, or terminated by ``close()``
    after ``STOP_TIMEOUT_S``). ``sent``: batches it handed over (seq 0..sent-1);
    ``refused``: the trainer's ``dropped`` verdicts, by reason; ``bye``: the reason its
    ``end`` carried (``ok``, ``source_error``), None if it sent none (with several trainers:
    unless every trainer that welcomed it got its ``end``). ``trainers``: per trainer endpoint,
    ``sent`` (batches given to ZeroMQ for it) and ``lost`` (connections to it lost: it went
    away, or was silent past the heartbeat timeout); ``trainers_lost`` picks the lost ones.
    The figures are the worker's own report at its end: while it runs (or if it died without
    one) they are 0, empty and None.
    """

    worker: int
    name: str
    state: str
    exit_code: int | None
    sent: int = 0
    refused: Mapping[str, int] = dataclasses.field(default_factory=dict)
    bye: str | None = None
    error: str = ""
    trainers: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def trainers_lost(self) -> dict[str, int]:
        """``{endpoint: connections lost}`` of every trainer this worker lost at least once."""
        return {e: t["lost"] for e, t in self.trainers.items() if t.get("lost")}


class Producers:
    """``options.workers`` producer processes that push batches to the trainers at
    ``options.connect`` (one, or several: each batch to exactly one, ``producer.fanout``):
    ``stagefeed produce`` in Python (the command runs this object).

    ::

        options = stagefeed.ProducerOptions(
            connect=("tcp://trainer-0:5555", "tcp://trainer-1:5555"), workers=4,
            source="mypkg.data:batches", max_batches=100)
        with stagefeed.Producers(options) as producers:  # start() ... close()
            producers.wait()  # until every worker ended; raises a worker's error
        print(producers.books())

    Lifecycle: ``start()`` once; then ``wait(timeout)``, ``alive()``, ``books()`` any number of
    times; ``close()`` (idempotent) sets the stop flag, joins every process within
    ``STOP_TIMEOUT_S``, then terminates and kills: nothing is left running. The processes are
    spawned (a fresh interpreter each, importing neither TensorFlow nor ``__main__``'s
    unguarded code when run from a notebook; a script needs the usual ``if __name__ ==
    "__main__":``). Workers send nothing to named shared memory or files: with ``transport``
    shm their pools are anonymous memory, freed with the process.

    Errors: a worker whose source fails delivers the batches it made, tells the trainer why
    (``source_error``), and exits; ``wait()`` then raises its error as the worker reported it:
    the ``ConfigError`` (a ``SchemaMismatch``: wrong dtype, labels out of bounds) or
    ``BrokenError`` (an exception in the source) that ``stagefeed produce`` prints in one line
    (exit 2 or 3). A worker that exits non-zero without a report raises ``BrokenError`` naming
    it. Workers stopped by ``close()`` or a signal exit 0 and are no failure; only the exit
    codes of workers ``close()`` had to terminate or kill are ours.

    ``log_level``: the workers' logging level (default: this process's root logger's).
    """

    def __init__(self, options: ProducerOptions, log_level: int | None = None) -> None:
        if not isinstance(options, ProducerOptions):
            raise TypeError(f"Producers takes ProducerOptions, not {type(options).__name__}")
        self.options = options
        self._ctx = multiprocessing.get_context("spawn")
        # Pipes, not multiprocessing's Event/Queue: nothing in /dev/shm survives a SIGKILL.
        self._stop = StopFlag(self._ctx)
        self._reports = WorkerReports(self._ctx)
        self._log_level = logging.getLogger().level if log_level is None else log_level
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._forced: set[int] = set()  # id() of the processes close() terminated or killed
        self._started = False
        self._closed = False

    def start(self) -> Producers:
        """Start the workers (``ConfigError`` first if ``options.curve_keys`` is unusable).
        Once only; ``ClosedError`` after ``close()``."""
        if self._closed:
            raise ClosedError("Producers closed")
        if self._started:
            raise RuntimeError("Producers.start() was called already")
        if self.options.curve_keys:
            from stagefeed.common.curve import client_configurator

            client_configurator(self.options.curve_keys)  # names the file it cannot use
        self._started = True
        # The tracker unblocks SIGINT and SIGTERM in this thread when it starts: start it first.
        resource_tracker.ensure_running()
        with _stop_signals_blocked():
            for index in range(self.options.workers):
                proc = self._ctx.Process(
                    target=worker_main,
                    args=(self.options, index, self._stop, self._log_level, self._reports),
                    name=f"stagefeed-producer-{index}",
                    daemon=True,
                )
                proc.start()
                self.processes.append(proc)
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for every worker to end by itself.

        True if all have ended, False if some still run at the deadline. Raises, as soon as
        one is known, the first failure a worker reported (``ConfigError`` / ``BrokenError``,
        the one-line error of ``stagefeed produce``), or ``BrokenError`` naming the workers
        that exited non-zero without a report.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._raise_failures()
            running = [p.sentinel for p in self.processes if p.is_alive()]
            left = None if deadline is None else deadline - time.monotonic()
            if not running or (left is not None and left <= 0):
                self._raise_failures()  # a report may have come with the last exit
                return not running
            multiprocessing.connection.wait([*running, self._reports.reader], left)

    def alive(self) -> int:
        """Workers still running."""
        return sum(p.is_alive() for p in self.processes)

    def close(self, hurry: Callable[[], bool] | None = None) -> None:
        """Stop every worker and join it (see the class docstring). Idempotent; never raises a
        worker's failure (``wait(0)`` after it does). ``hurry()``, polled while joining, cuts
        the wait short (the command line: a second Ctrl-C)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        forced = stop_processes(self.processes, STOP_TIMEOUT_S, hurry)
        self._forced.update(id(p) for p in forced)
        self._reports.read()

    def failures(self) -> list[str]:
        """``name (exit N)`` of every worker that failed (see the class docstring)."""
        return [
            f"{p.name} (exit {p.exitcode})"
            for p in self.processes
            if p.exitcode not in (None, 0) and id(p) not in self._forced
        ]

    def books(self) -> list[WorkerBook]:
        """Each worker's ``WorkerBook``, in worker order: what it reported at its end."""
        self._reports.read()
        return [self._book(index, proc) for index, proc in enumerate(self.processes)]

    def health_check(
        self, ended: type[Exception] = BrokenError, ends_grace_s: float = 0.0
    ) -> Callable[[], None]:
        """A trainer's ``health_check`` (``Trainer.train``, ``Feed``) that raises once no
        worker is alive: see ``pool_check``."""
        return pool_check(self, ended, ends_grace_s)

    def _book(self, index: int, proc: multiprocessing.process.BaseProcess) -> WorkerBook:
        code = proc.exitcode
        report = self._reports.of(index)
        if code is None or report is None:
            state = "running" if code is None else "killed"
            return WorkerBook(index, proc.name, state, code)
        return WorkerBook(
            index, proc.name, report["state"], code, report["sent"], report["refused"],
            report["bye"], report["error"], report["trainers"],
        )  # fmt: skip

    def _raise_failures(self) -> None:
        reported = self._reports.first()  # a worker's own one-line ConfigError/BrokenError
        if reported is not None:
            raise reported
        failed = self.failures()
        if failed:
            raise BrokenError(f"producer processes failed: {', '.join(failed)}")

    def __enter__(self) -> Producers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.alive()} of {len(self.processes)} alive"
        trainers = ", ".join(self.options.connect)
        return f"<Producers {self.options.workers} -> {trainers}: {state}>"


class _Pool(Protocol):
    """What the check needs of ``Producers``."""

    def alive(self) -> int: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def books(self) -> list[WorkerBook]: ...


def pool_check(
    pool: _Pool, ended: type[Exception] = BrokenError, ends_grace_s: float = 0.0
) -> Callable[[], None]:
    """A ``health_check`` that raises once no process of ``pool`` is alive.

    A producer that failed raises its error (``ConfigError`` / ``BrokenError``) from
    ``pool.wait(0)``. If every producer ended cleanly, ``ended("all producers ended")``:
    ``BrokenError`` where producers are meant to run until stopped (the benchmarks), or
    ``ClosedError`` where they may finish first (``stagefeed run --max-batches``: the launcher).
    While any producer is alive the check costs one ``is_alive()`` per process and a read of
    their reports.

    ``ends_grace_s``: when every worker said ``end`` before it exited (its data ended, or its
    source failed after delivering what it made), the check stays quiet that long, so that
    the trainer's own rule (``consumer.run_end``) sees the data end and trains the tail
    first; the caller reports a failed worker after training (docs/guarantees.md, "When the
    data ends"). A worker that died without its ``end`` is raised at once.

    A worker whose source failed after it delivered what it made (its report says ``failed``
    and its ``end`` went out) ends the intake while the others still run: ``ended(...)``, so
    the trainer trains what was delivered and the caller reports the failure after. The others
    are not waited for: one may wait for the failed shard's pass end, which never comes (a
    source with passes), and the run fails either way.
    """
    all_ended_at: list[float] = []

    def check() -> None:
        if pool.alive():
            failed = [b for b in pool.books() if b.state == "failed" and b.bye is not None]
            if failed:
                raise ended(f"producer {failed[0].name}'s source failed")
            return
        if ends_grace_s > 0 and all(book.bye is not None for book in pool.books()):
            if not all_ended_at:
                all_ended_at.append(time.monotonic())
            if time.monotonic() - all_ended_at[0] < ends_grace_s:
                return
        pool.wait(0)  # raises the failure of any that failed
        raise ended("all producers ended")

    return check
