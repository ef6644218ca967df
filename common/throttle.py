"""A log line per key at most every few seconds: a flood of bad input must not flood the log.

One instance per place that logs what a peer can make it log (drops by reason, refused hellos
and peers, unexpected errors, a producer's notices). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

INTERVAL_S = 5.0


class LogThrottle:
    """``due(key)`` is True at most once per ``interval_s`` for each key (the first time too)."""

    def __init__(
        self, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}

    def due(self, key: str = "") -> bool:
        """True if a line for ``key`` may go out now (and then it counts as gone out)."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                return False
            self._last[key] = now
            return True
