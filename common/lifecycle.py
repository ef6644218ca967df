"""One shutdown routine for everything stagefeed starts: stop flag, join with timeout, kill.

``Shutdown`` turns SIGINT and SIGTERM into two flags: the first signal asks for a stop, any
signal after that (a second Ctrl-C, ``docker stop`` during shutdown) makes the stop *urgent*,
and the shutdown routine then cuts its grace periods. No signal ever raises: the old design
raised ``KeyboardInterrupt`` on the second signal, which escaped ``pool.close()`` wherever it
landed and left the trainer, its non-daemon threads and the producers running.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What a grace period shrinks to once the stop is urgent.
URGENT_S = 0.5
# How often a join looks at the urgent flag.
POLL_S = 0.1
# A terminated process gets this long to exit before it is killed.
TERMINATE_GRACE_S = 1.0


def join_threads(threads: Iterable[threading.Thread], timeout_s: float) -> list[str]:
    """Join each thread within a shared deadline; return the names of those still alive."""

    deadline = time.monotonic() + timeout_s
    stuck = []
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            stuck.append(thread.name)
    if stuck:
        log.error("threads did not stop within %.1f s: %s", timeout_s, ", ".join(stuck))
    return stuck


def stop_processes(
    processes: Iterable[Any], timeout_s: float, hurry: Callable[[], bool] | None = None
) -> list[Any]:
    """Join processes whose stop flag is already set; terminate, then kill, the late ones.

    ``hurry()``, polled while joining, cuts the wait short: the late ones are terminated at
    once. Returns the processes that were terminated or killed, whose exit codes are ours.
    """
    processes = list(processes)
    began = time.monotonic()
    deadline = began + timeout_s
    for proc in processes:
        while proc.is_alive() and not (hurry is not None and hurry()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            proc.join(min(left, POLL_S))
    late = [proc for proc in processes if proc.is_alive()]
    for proc in late:
        waited = time.monotonic() - began
        log.warning("%s still running after %.1f s; terminating", proc.name, waited)
        proc.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in late:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in late:
        if proc.is_alive():
            log.error("%s ignored SIGTERM; killing", proc.name)
            proc.kill()
            proc.join(TERMINATE_GRACE_S)
    return late


def _no_python_work(_signum: int, _frame: Any) -> None:
    # The Python-level handler does nothing: it only keeps the default action (exit, or
    # KeyboardInterrupt) from happening. The work is done on the thread that reads the wakeup
    # socket, where taking a lock or writing a log line cannot deadlock the interrupted code.
    return None


class Shutdown:
    """The stop request of a command, from a signal or from the command itself.

    - ``stop`` (a ``threading.Event``) is set by the first SIGINT/SIGTERM, or by ``begin()``
      when the command ends by itself (steps done, producers finished).
    - ``urgent`` is set by any signal that arrives once ``stop`` is set: ``grace(s)`` then
      returns at most ``URGENT_S``, and joins polling ``urgent`` stop waiting.
    - ``by_signal``: a signal, not the command, asked for the stop ("interrupted").

    ``install()`` (main thread only) routes the signals through CPython's wakeup fd to the
    named daemon thread ``stagefeed-signals``, which sets the flags, logs, and calls
    ``on_stop(signum)`` / ``on_urgent(signum)``. In the interrupted thread nothing happens at
    all, so a signal may arrive at any moment: inside a lock, a log write, a ``finally``.
    ``restore()`` (idempotent) puts the previous handlers back and joins the thread;
    ``finish()`` ignores the signals instead, for a process about to exit.
    """

    def __init__(
        self,
        on_stop: Callable[[int], None] | None = None,
        on_urgent: Callable[[int], None] | None = None,
    ) -> None:
        self.stop = threading.Event()
        self.urgent = threading.Event()
        self.by_signal = False
        self.received = 0
        self._on_stop = on_stop
        self._on_urgent = on_urgent
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._old_wakeup_fd = -1
        self._writer: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> Shutdown:
        if self._thread is not None:
            return self
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # set_wakeup_fd requires it; a full buffer drops the byte
        self._writer = writer
        self._previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        # The wakeup fd first: a signal between the two calls then still gets through.
        self._old_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, _no_python_work)
        self._thread = threading.Thread(
            target=self._watch, args=(reader,), name="stagefeed-signals", daemon=True
        )
        self._thread.start()
        return self

    def restore(self) -> None:
        if self._thread is None or self._writer is None:
            return
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._old_wakeup_fd)
        self._writer.close()  # the thread reads EOF and ends
        self._writer = None
        join_threads([self._thread], 1.0)

    def finish(self) -> None:
        """The command is over (everything closed, summary written): from now on SIGINT and
        SIGTERM are ignored. CPython puts the default actions back late in its finalization,
        so a signal then would kill the exiting process (status -2) and skip what is left of
        it, multiprocessing's semaphore clean-up included."""
        if self._thread is None:
            return
        self._previous = {sig: signal.SIG_IGN for sig in STOP_SIGNALS}
        self.restore()

    def begin(self) -> None:
        """The command ends by itself: a signal from now on makes the shutdown urgent."""
        with self._lock:
            self.stop.set()

    def grace(self, normal_s: float) -> float:
        """A grace period's length now: ``normal_s``, or at most ``URGENT_S`` once urgent."""
        return min(normal_s, URGENT_S) if self.urgent.is_set() else normal_s

    def _watch(self, reader: socket.socket) -> None:
        with reader:
            while True:
                try:
                    data = reader.recv(64)
                except OSError:
                    return
                if not data:
                    return
                for signum in data:  # one byte per signal: its number
                    if signum in STOP_SIGNALS:
                        self._signalled(signum)

    def _signalled(self, signum: int) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            self.received += 1
            first = not self.stop.is_set()
            newly_urgent = not first and not self.urgent.is_set()
            if first:
                self.by_signal = True
                self.stop.set()
            else:
                self.urgent.set()
        if first:
            log.info("%s received: stopping (a second signal cuts the shutdown short)", name)
            if self._on_stop is not None:
                self._on_stop(signum)
        elif newly_urgent:
            log.warning("%s received while stopping: shutting down without grace periods", name)
            if self._on_urgent is not None:
                self._on_urgent(signum)


def on_stop_signals(
    handler: Callable[[int], None], on_urgent: Callable[[int], None] | None = None
) -> Callable[[], None]:
    """Route the first SIGINT/SIGTERM to ``handler(signum)`` and a later one to ``on_urgent``
    (see ``Shutdown``); no signal raises. Returns a function restoring the previous handlers.
    Main thread only."""
    return Shutdown(handler, on_urgent).install().restore


def reclaim_stop_signals() -> list[str]:
    """Put Python's SIGINT and SIGTERM handlers back in force after a library replaced them
    below Python; the names of the signals set again. Main thread only (else nothing is done).

    ``signal.getsignal`` reads Python's own table, not the process's: a C library that calls
    ``signal()``/``sigaction()`` takes the signal while ``getsignal`` still names the Python
    handler, which then never runs. TensorFlow does so for SIGTERM once
    ``MultiWorkerMirroredStrategy`` starts its coordination service (TF 2.21: the preemption
    notifier of ``libtensorflow_cc``, which only records it), so a cluster worker ignored
    SIGTERM. Setting the same Python handler again installs CPython's C handler again.
    """
    if threading.current_thread() is not threading.main_thread():
        log.warning("stop signals not reclaimed: not on the main thread")
        return []
    names = []
    for sig in STOP_SIGNALS:
        handler = signal.getsignal(sig)
        if handler is not None:  # None: not set from Python, nothing to put back
            signal.signal(sig, handler)
            names.append(signal.Signals(sig).name)
    return names


def exit_if_threads_left(code: int, timeout_s: float) -> None:
    """Last resort at the end of a command, once everything was closed and the summary written.

    A non-daemon thread still alive (a join that timed out, logged where it happened) would
    keep the interpreter from exiting. Such threads get ``timeout_s``; then the process ends
    with ``code`` without waiting for them.
    """
    current = threading.current_thread()
    left = [t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()]
    if not left or not join_threads(left, timeout_s):
        return
    log.error("exiting with threads still running (see above)")
    end_process(code)


def end_process(code: int) -> NoReturn:
    """End the process with ``code`` now, once the log handlers, stdout and stderr are
    flushed: no interpreter teardown (atexit, destructors, threads still running)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
