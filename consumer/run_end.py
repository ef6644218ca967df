"""When a run ends, and why: one decision that both trainers consult while they wait for data.

``RunEnd.poll()`` looks at what can end a run, highest first, and returns a ``Verdict``:

- ``FAIL``: a check failed: the intake broke, a producer process failed (``BrokenError``), or
  a check raised anything else. The run ends now and the trainer raises ``verdict.failure``
  as it came.
- A producer's source failed (a check raised the ``ConfigError`` its worker reported: a wrong
  or short batch): ``DRAIN`` with ``failure`` set, once that producer's data ended or
  ``gone_grace_s`` passed (it delivered its good batches before it exited). The queue closes,
  what is queued is trained, then the trainer raises ``verdict.failure`` (exit 2): good
  batches are trained, never thrown away for a later bad one.
- ``STOP``: a stop was requested (the ``stop`` event: a signal, the user). The run ends now;
  what is queued stays queued and is booked as such.
- ``DRAIN``: the data ended: every producer that delivered said ``end`` and every batch they
  sent is in the queue (``data_ended``, the intake's rule, docs/guarantees.md), and that held
  for ``end_grace_s`` (0 for the CLI trainers; ``ServedFeed`` waits a little for producers
  that start late: a new hello in the grace makes ``data_ended`` false again). Or every
  producer process ended without saying so (a check raised ``ClosedError``), and
  ``gone_grace_s`` passed for their last batches to reach the queue. The queued tail is
  trained, then the run ends.
- ``RUNNING`` otherwise.

Invariants: verdicts only rise (``RUNNING < DRAIN < STOP < FAIL``): a stop during a drain
stops, a failure during either fails, and nothing goes back to running; the first verdict of
the highest level is kept with its reason, unless a later one of that level carries a
failure (a drain that turns out to follow a source's failure still ends in that failure).
``poll`` never raises. The run's length in steps
is the trainers' loop bound, not decided here.

Whether a run that ended is *finished* (nothing resumes it: its final state's ``finished``,
which ``consumer.resume`` refuses to resume) is decided by what was planned and trained, never
by a race with the intake: ``finished_because`` is the one rule of the graph, Keras and
cluster trainers and of ``ServedFeed.saved``.

Why the ordering matters beyond one process: with several workers (MultiWorkerMirroredStrategy)
a collective max of ``int(verdict.ending)`` at a step boundary gives every worker the same
decision at the same step, so none is left waiting in an all-reduce.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence

from stagefeed.common.errors import ClosedError, ConfigError
from stagefeed.common.position import InputPosition, passes_trained

log = logging.getLogger(__name__)

# After every producer process ended without their data having ended (no ``end`` seen), how
# long the batches they sent may take to reach the queue before the run drains.
GONE_GRACE_S = 2.0
# How long a trainer that trained its planned passes waits for the producers' ``end`` (their
# data ends with those passes; the last batch can train before its ``end`` is booked).
END_SETTLE_S = 2.0
# How often a watcher thread looks at the verdict (``RunEnd.watch``): a stop, a failure or a
# drain reaches a trainer waiting for data within this.
WATCH_S = 0.1


def finished_because(
    *,
    step: int,
    planned_steps: int,
    planned_passes: int,
    position: InputPosition | None,
    data_ended: bool = False,
) -> str:
    """Why a run is done after ``step``, or "" if it may go on (resumed): every planned pass
    of a source with passes is trained (``position``'s pass ends, every shard's, all trained:
    ``planned_passes``, ``--epochs``), its ``planned_steps`` are done (0: none planned), or
    every producer's data ended and all of it was trained (``data_ended``). The trained
    position decides, not whether the producers' ``end`` reached the intake before the save."""
    if data_ended:
        return "every producer's data ended"
    passes = passes_trained(position) if position is not None else None
    if passes is not None and passes >= planned_passes:
        return f"its passes trained (--epochs {planned_passes})"
    return f"{planned_steps} steps done" if planned_steps and step >= planned_steps else ""


class Ending(enum.IntEnum):
    RUNNING = 0
    DRAIN = 1
    STOP = 2
    FAIL = 3


@dataclasses.dataclass(frozen=True)
class Verdict:
    ending: Ending
    reason: str = ""
    failure: BaseException | None = None  # FAIL; DRAIN after a producer's source failed
    data_ended: bool = False  # DRAIN because every producer's data ended (not just gone)


RUNNING = Verdict(Ending.RUNNING)


class RunEnd:
    """The decision for one trainer (see the module docstring). Thread-safe."""

    def __init__(
        self,
        stop: threading.Event,
        data_ended: Callable[[], bool],
        checks: Sequence[Callable[[], None]] = (),
        gone_grace_s: float = GONE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        end_grace_s: float = 0.0,
    ) -> None:
        self.stop = stop
        self.data_ended = data_ended
        self.checks = list(checks)
        self.gone_grace_s = gone_grace_s
        self.end_grace_s = end_grace_s
        self.clock = clock
        self._lock = threading.Lock()
        self._verdict = RUNNING
        self._gone_at: float | None = None
        self._gone_because = ""  # the producers' ``ClosedError``: why their intake is over
        self._ended_at: float | None = None  # since when ``data_ended`` holds
        self._source_failed_at: float | None = None

    @property
    def verdict(self) -> Verdict:
        """The latest verdict, without looking again."""
        return self._verdict

    def watch(self, done: threading.Event, act: Callable[[Verdict], bool]) -> None:
        """The watcher threads' loop (the Keras fit watcher, a cluster worker's, ``ServedFeed``'s):
        every ``WATCH_S`` until ``done`` is set, ``act`` on a fresh verdict; it returns True once
        there is nothing more to watch. ``act`` also does the thread's idle work (the waiting
        line) while the verdict lets the run go on."""
        while not done.wait(WATCH_S):
            if act(self.poll()):
                return

    def settle(self, timeout_s: float = END_SETTLE_S) -> Verdict:
        """Poll every ``WATCH_S`` until the verdict is not ``RUNNING``, for at most
        ``timeout_s``; the verdict. For a trainer whose planned passes are trained: its
        producers' data ends with them, and their ``end`` may follow the last step by a poll."""
        deadline = self.clock() + timeout_s
        verdict = self.poll()
        while verdict.ending is Ending.RUNNING and self.clock() < deadline:
            time.sleep(WATCH_S)
            verdict = self.poll()
        return verdict

    def poll(self) -> Verdict:
        """Look at every input once; the verdict, which never goes down."""
        with self._lock:
            self._raise_to(self._look())
            return self._verdict

    def _look(self) -> Verdict:
        if self.stop.is_set():
            return Verdict(Ending.STOP, "stop requested")
        for check in self.checks:
            try:
                check()
            except ClosedError as exc:  # producers ended (or a source failed): drain after a grace
                if self._gone_at is None:
                    self._gone_at = self.clock()
                    self._gone_because = str(exc)
                    log.info("%s: training what was delivered", exc)
            except ConfigError as exc:  # a producer's source: train its good batches first
                if self._source_failed_at is None:
                    self._source_failed_at = self.clock()
                    log.info("a producer's source failed: training what was delivered, then "
                             "failing (%s)", exc)  # fmt: skip
                waited = self.clock() - self._source_failed_at
                if self.data_ended() or waited >= self.gone_grace_s:
                    return Verdict(Ending.DRAIN, f"a producer's source failed: {exc}",
                                   failure=exc)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - every failure ends the run, by its type
                return Verdict(Ending.FAIL, f"{type(exc).__name__}: {exc}", failure=exc)
        if not self.data_ended():
            self._ended_at = None
        elif self._ended_at is None and self.end_grace_s > 0:
            self._ended_at = self.clock()
        elif self._ended_at is None or self.clock() - self._ended_at >= self.end_grace_s:
            return Verdict(Ending.DRAIN, "every producer's data ended", data_ended=True)
        if self._gone_at is not None and self.clock() - self._gone_at >= self.gone_grace_s:
            return Verdict(Ending.DRAIN, self._gone_because)
        return RUNNING

    def _raise_to(self, verdict: Verdict) -> None:
        current = self._verdict
        failing = verdict.failure is not None and current.failure is None
        if verdict.ending > current.ending or (verdict.ending == current.ending and failing):
            self._verdict = verdict
