"""Covers ``consumer/run_facts.py``'s ``StepClock``: the one split of a step's time into its
wait for a batch and its compute, for the ``fit`` and cluster trainers."""

from __future__ import annotations

import time

from stagefeed.consumer.run_facts import StepClock


def test_a_step_waits_what_the_total_grew_by_and_never_more_than_it_took() -> None:
    clock = StepClock()
    time.sleep(0.05)
    wait, step_s, _ = clock.split(0.02)  # waited 0.02 of the ~0.05 since the start
    assert wait == 0.02 and step_s >= 0.02
    time.sleep(0.01)
    wait, step_s, _ = clock.split(5.0)  # a total far past the step's own time
    assert 0.0 < wait <= 0.5 and step_s == 0.0
    wait, _, _ = clock.split(4.0)  # a total that went back (a new feed): no negative wait
    assert wait == 0.0


def test_restart_starts_the_time_between_steps_afresh() -> None:
    clock = StepClock()
    time.sleep(0.05)
    clock.restart()
    wait, step_s, _ = clock.split(1.0)
    assert wait + step_s < 0.05
