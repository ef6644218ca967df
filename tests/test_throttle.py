"""``common/throttle.py``: one log line per key per interval, whatever floods in."""

from __future__ import annotations

from stagefeed.common.throttle import LogThrottle


def test_a_key_is_due_once_per_interval_and_keys_are_apart():
    now = [100.0]
    throttle = LogThrottle(5.0, clock=lambda: now[0])
    assert [throttle.due("parts") for _ in range(1000)].count(True) == 1  # a flood: one line
    assert throttle.due("header")  # another reason has its own line
    now[0] += 4.9
    assert not throttle.due("parts")
    now[0] += 0.1
    assert throttle.due("parts") and not throttle.due("parts")


def test_the_first_line_goes_out_whatever_the_clock_says():
    assert LogThrottle(5.0, clock=lambda: 0.0).due()
