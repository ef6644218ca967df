"""consumer/observe/host_cpu.py: the "cpu" line of /proc/stat read, and the busy share between
two readings (what the advice says about the host's cores)."""

from __future__ import annotations

import math

from stagefeed.consumer.observe.host_cpu import CpuTimes, busy_pct, host_cores, read_cpu_times


def test_the_cpu_line_counts_idle_and_iowait_as_not_busy(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 10 50 800 40 0 0 0 7 0\ncpu0 50 5 25 400 20 0 0 0 0 0\n")
    assert read_cpu_times(str(stat)) == CpuTimes(busy=160, total=1000)


def test_an_unreadable_or_foreign_file_is_unknown(tmp_path):
    assert read_cpu_times(str(tmp_path / "absent")) is None
    odd = tmp_path / "odd"
    for text in ["", "intr 1 2 3 4 5\n", "cpu  1 2 x 4 5\n", "cpu 1 2\n"]:
        odd.write_text(text)
        assert read_cpu_times(str(odd)) is None, text


def test_the_busy_share_between_two_readings():
    assert busy_pct(CpuTimes(100, 1000), CpuTimes(250, 1200)) == 75.0
    assert math.isnan(busy_pct(None, CpuTimes(1, 2)))
    assert math.isnan(busy_pct(CpuTimes(5, 10), CpuTimes(5, 10)))  # no time between them


def test_this_host_can_be_read():
    assert host_cores() >= 1
    first = read_cpu_times()
    assert first is not None and 0 < first.busy < first.total
