"""How many batches the intake made available to the train loop (enqueued in the FIFOQueue)."""

from __future__ import annotations

import threading


class Availability:
    """Batches made available in the FIFOQueue, counted after each enqueue returns.

    Invariant: ``enqueued - consumed`` (the train loop's count of dequeues) is a lower bound on
    the queue's size, so a dequeue issued when it is positive never blocks.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.enqueued = 0

    def add(self) -> None:
        with self._cond:
            self.enqueued += 1
            self._cond.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        """True once at least ``count`` batches were enqueued in total."""
        with self._cond:
            return self._cond.wait_for(lambda: self.enqueued >= count, timeout_s)
