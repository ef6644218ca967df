"""The line a trainer logs while it waits for data: what it waits for, for how long, and where.

    waiting for data for 20 s (0 producers seen, listening on tcp://0.0.0.0:5555)

Every trainer says it the same way, every ``TrainerOptions.wait_log_s`` (``--wait-log-s``,
10 s) of one wait: graph mode from its own wait for a batch; ``fit`` and the cluster loop
from their watcher threads, which see the wait as the queue staying empty with no step
ending (``starved``). A trainer with no producer, or whose producers were all refused, is
then never silent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class WaitLine:
    """One wait's line, every ``interval_s`` of it; ``waiting()`` while it lasts, ``over()``
    when data came. Used by one thread."""

    def __init__(
        self,
        interval_s: float,
        producers: Callable[[], int],
        endpoint: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.producers = producers  # producers seen so far
        self.endpoint = endpoint
        self.clock = clock
        self._began: float | None = None
        self._said = 0.0
        self._steps: int | None = None  # ``starved``: the steps done at its last call

    def waiting(self) -> None:
        """Still waiting (the first call starts the wait): the line, if one is due."""
        now = self.clock()
        if self._began is None:
            self._began = self._said = now
        elif now - self._said >= self.interval_s:
            self._said = now
            log.info("waiting for data for %.0f s (%d producers seen, listening on %s)",
                     now - self._began, self.producers(), self.endpoint)  # fmt: skip

    def over(self) -> None:
        """The wait ended; the next ``waiting()`` starts another."""
        self._began = None

    def starved(self, steps: int, queued: int) -> None:
        """For a watcher beside the training thread: waiting while the queue is empty and no
        step ended since the last call (``steps``: steps done so far; ``queued``: batches in
        the queue now)."""
        if queued or (self._steps is not None and steps != self._steps):
            self.over()
        else:
            self.waiting()
        self._steps = steps
