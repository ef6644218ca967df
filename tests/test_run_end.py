"""``consumer/run_end.py``: the one decision of when a run ends, and why."""

from __future__ import annotations

import threading

import pytest

from stagefeed.common.errors import BrokenError, ClosedError, ConfigError
from stagefeed.consumer.run_end import Ending, RunEnd


class Inputs:
    """What a RunEnd looks at, set by the test; the clock moves only when told."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.ended = False
        self.raises: BaseException | None = None
        self.now = 0.0

    def check(self) -> None:
        if self.raises is not None:
            raise self.raises

    def run_end(self, grace_s: float = 2.0) -> RunEnd:
        return RunEnd(self.stop, lambda: self.ended, [self.check], grace_s, lambda: self.now)


def test_running_until_something_ends_the_run():
    inputs = Inputs()
    assert inputs.run_end().poll().ending is Ending.RUNNING


def test_the_data_ending_drains_and_says_so():
    inputs = Inputs()
    run_end = inputs.run_end()
    inputs.ended = True
    verdict = run_end.poll()
    assert (verdict.ending, verdict.data_ended) == (Ending.DRAIN, True)


def test_an_end_grace_waits_for_late_producers_and_a_new_hello_restarts_it():
    inputs = Inputs()
    run_end = RunEnd(inputs.stop, lambda: inputs.ended, [], clock=lambda: inputs.now,
                     end_grace_s=1.0)  # fmt: skip
    inputs.ended = True
    assert run_end.poll().ending is Ending.RUNNING  # the grace starts
    inputs.now = 0.5
    inputs.ended = False  # a late producer said hello: its data has not ended
    assert run_end.poll().ending is Ending.RUNNING
    inputs.ended, inputs.now = True, 0.7
    assert run_end.poll().ending is Ending.RUNNING  # a new grace from 0.7
    inputs.now = 1.6
    assert run_end.poll().ending is Ending.RUNNING
    inputs.now = 1.7
    verdict = run_end.poll()
    assert (verdict.ending, verdict.data_ended) == (Ending.DRAIN, True)


def test_producers_gone_without_end_drain_after_the_grace_only():
    inputs = Inputs()
    run_end = inputs.run_end(grace_s=2.0)
    inputs.raises = ClosedError("all producers ended")
    assert run_end.poll().ending is Ending.RUNNING
    inputs.now = 1.9
    assert run_end.poll().ending is Ending.RUNNING
    inputs.now = 2.0
    verdict = run_end.poll()
    assert (verdict.ending, verdict.data_ended) == (Ending.DRAIN, False)
    assert verdict.reason == "all producers ended"  # the check's own words


@pytest.mark.parametrize("error", [BrokenError("intake broke"), RuntimeError("a bug")])
def test_any_failed_check_fails_the_run_with_the_exception_as_it_came(error):
    inputs = Inputs()
    inputs.raises = error
    verdict = inputs.run_end().poll()
    assert verdict.ending is Ending.FAIL and verdict.failure is error
    assert type(error).__name__ in verdict.reason


def test_a_source_that_failed_drains_its_good_batches_then_fails():
    """A producer's ConfigError (a wrong or short batch) drains first: once its data ended,
    or after the grace for its batches to arrive; the failure rides on the DRAIN verdict,
    also when the plain data-ended DRAIN was seen first."""
    inputs = Inputs()
    run_end = inputs.run_end(grace_s=2.0)
    error = ConfigError("source 'x' batch 2 is short")
    inputs.raises = error
    assert run_end.poll().ending is Ending.RUNNING  # its last batches may be on their way
    inputs.now = 2.0
    verdict = run_end.poll()
    assert (verdict.ending, verdict.failure, verdict.data_ended) == (Ending.DRAIN, error, False)
    inputs = Inputs()
    run_end = inputs.run_end()
    inputs.ended = True  # its end (reason source_error) came before its process exited
    assert run_end.poll().failure is None
    inputs.raises = error
    verdict = run_end.poll()
    assert verdict.ending is Ending.DRAIN and verdict.failure is error


def test_verdicts_only_rise_and_the_first_of_a_level_is_kept():
    inputs = Inputs()
    run_end = inputs.run_end()
    inputs.ended = True
    assert run_end.poll().ending is Ending.DRAIN
    inputs.ended = False  # nothing goes back to running
    assert run_end.poll().ending is Ending.DRAIN
    inputs.stop.set()  # a stop during a drain stops
    assert run_end.poll().ending is Ending.STOP
    first = BrokenError("first")
    inputs.stop.clear()
    inputs.raises = first
    assert run_end.poll().failure is first  # a failure during a stop fails
    inputs.raises = BrokenError("second")
    assert run_end.poll().failure is first
    inputs.stop.set()
    assert run_end.poll().ending is Ending.FAIL
    assert run_end.verdict.failure is first


def test_the_levels_are_ordered_for_a_collective_max():
    assert sorted(Ending) == [Ending.RUNNING, Ending.DRAIN, Ending.STOP, Ending.FAIL]


def test_settle_waits_for_an_end_that_follows_the_last_step():
    inputs, looks = Inputs(), []

    def ended() -> bool:  # the producers' ``end`` is booked on the third look
        looks.append(1)
        return len(looks) >= 3

    run_end = RunEnd(inputs.stop, ended, [], clock=lambda: inputs.now)
    verdict = run_end.settle(timeout_s=2.0)
    assert (verdict.ending, verdict.data_ended, len(looks)) == (Ending.DRAIN, True, 3)


def test_settle_gives_up_after_its_timeout_with_the_run_still_running():
    inputs = Inputs()
    times = iter(range(100))  # each look at the clock is a second later
    run_end = RunEnd(inputs.stop, lambda: False, [], clock=lambda: float(next(times)))
    assert run_end.settle(timeout_s=3.0).ending is Ending.RUNNING
    assert next(times) < 10  # it stopped looking once the timeout had passed
