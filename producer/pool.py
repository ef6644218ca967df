"""A supervised group of producer processes (``stagefeed produce --workers N``)."""

from __future__ import annotations

import logging
import multiprocessing

from stagefeed.common.errors import BrokenError
from stagefeed.common.lifecycle import stop_processes
from stagefeed.common.options import ProducerOptions
from stagefeed.producer.worker import FailureReports, worker_main

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 4.0


class ProducerPool:
    """Starts ``options.workers`` named producer processes with the spawn context.

    Lifecycle: ``start()`` once, then ``wait()`` and/or ``close()``. ``close()`` is idempotent:
    it sets the shared stop event, joins within ``STOP_TIMEOUT_S``, then terminates and kills.
    """

    def __init__(self, options: ProducerOptions, log_level: int = logging.INFO) -> None:
        self.options = options
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = self._ctx.Event()
        self._failures = FailureReports(self._ctx)
        self._log_level = log_level
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._closed = False

    def start(self) -> ProducerPool:
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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        stop_processes(self.processes, STOP_TIMEOUT_S)

    def _raise_failures(self) -> None:
        reported = self._failures.first()  # a worker's own one-line ConfigError/BrokenError
        if reported is not None:
            raise reported
        failed = [
            f"{p.name} (exit {p.exitcode})"
            for p in self.processes
            if p.exitcode not in (None, 0) and not self._stop.is_set()
        ]
        if failed:
            raise BrokenError(f"producer processes failed: {', '.join(failed)}")

    def __enter__(self) -> ProducerPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
