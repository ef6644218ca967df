"""One shutdown routine for everything stagefeed starts: stop flag, join with timeout, kill."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


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


def stop_processes(processes: Iterable[Any], timeout_s: float) -> None:
    """Join processes whose stop flag is already set; terminate, then kill, the late ones."""

    processes = list(processes)
    deadline = time.monotonic() + timeout_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            log.warning("%s did not stop within %.1f s; terminating", proc.name, timeout_s)
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            log.error("%s ignored SIGTERM; killing", proc.name)
            proc.kill()
            proc.join(1.0)


def on_stop_signals(handler: Callable[[int], None]) -> Callable[[], None]:
    """Route SIGINT and SIGTERM to ``handler(signum)``; a second signal raises KeyboardInterrupt.

    Returns a function restoring the previous handlers. Main thread only.
    """
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    seen = {"count": 0}

    def _handle(signum: int, _frame: Any) -> None:
        seen["count"] += 1
        if seen["count"] > 1:
            raise KeyboardInterrupt
        log.info("%s received: stopping", signal.Signals(signum).name)
        handler(signum)

    for sig in previous:
        signal.signal(sig, _handle)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
