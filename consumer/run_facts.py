"""What a trainer tells its observers, and all they may read of its run: the contract between
the trainers (``consumer.trainer_base`` and the three kinds) and ``consumer.observe``.

A ``StepRecord`` for each step, given to every ``StepObserver`` on the train loop; the run's
``RunFacts`` (fixed while it runs) and a ``RunReader`` (the queue fill now and one typed read of
the ledger's books). Observers get these, never the trainer. Below both sides: it imports only
the books.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

from stagefeed.consumer.books.books import LedgerSnapshot


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One train step, or ``steps`` of them run by one call (Keras' ``steps_per_execution``):
    ``step`` is the last; ``wait_s``, ``step_s`` are the call's. ``wait_s``: time the step
    waited for a batch before it could run."""

    step: int  # 1-based, warm-up steps included
    timed: bool  # False for warm-up steps
    wait_s: float
    step_s: float
    loss: float
    queue_batches: int  # batches in the FIFOQueue when the step started
    at: float  # time.monotonic() at the end of the step
    steps: int = 1  # the train steps this record covers

    @property
    def ms_per_step(self) -> float:
        """Wait and compute of one of its steps, in milliseconds."""
        return 1000.0 * (self.wait_s + self.step_s) / self.steps


class StepClock:
    """A step's wait and compute time from the feed's running total of time spent waiting for
    batches (``StepBooks``' ``wait_s``): the wait since the last step's end, never more than
    the time since then; the rest is the step. One clock for the ``fit`` and cluster
    trainers, which read the total after each step."""

    def __init__(self) -> None:
        self._last_end = time.monotonic()
        self._wait_s = 0.0

    def restart(self) -> None:
        """The time between steps starts now (the train loop begins)."""
        self._last_end = time.monotonic()

    def split(self, total_wait_s: float) -> tuple[float, float, float]:
        """``(wait_s, step_s, now)`` of the step that just ended."""
        now = time.monotonic()
        elapsed = now - self._last_end
        wait = min(max(total_wait_s - self._wait_s, 0.0), elapsed)
        self._last_end, self._wait_s = now, total_wait_s
        return wait, elapsed - wait, now


class StepObserver(Protocol):
    """Told of each step on the train loop (keep it short). Observers that need more than the
    record are given the trainer's ``facts`` and ``reader``, never the trainer."""

    def on_step(self, record: StepRecord) -> None: ...


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What the observers know of a run and that never changes while it runs."""

    device: str  # where the step runs: /cpu:0, /gpu:0
    batch_size: int
    batch_bytes: int  # one batch as it travels
    wire_dtype: str  # of the largest array on the wire
    queue_capacity: int  # FIFOQueue capacity, batches
    steps_planned: int = 0  # warm-up + timed steps; 0: until stopped


@dataclasses.dataclass(frozen=True)
class RunReader:
    """The live reads observers may make, each thread-safe and cheap (no TensorFlow call)."""

    queue_batches: Callable[[], int]  # FIFOQueue fill now (a lower bound)
    # The ledger's counters, one consistent read (``Ledger.read``).
    books: Callable[[], LedgerSnapshot]
