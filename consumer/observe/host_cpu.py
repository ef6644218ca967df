"""How busy the host's cores are: two readings of ``/proc/stat`` and the share between them.

The advice (``consumer.observe.advice``) reads it to tell "more producers on this host" from
"this host is saturated": a producer keeps about one core busy, so on a host whose cores are
all busy another producer only takes CPU from the ones running (and from the trainer).
Linux only; elsewhere, or with an unreadable file, a reading is None and the share unknown.
"""

from __future__ import annotations

import dataclasses
import math
import os

STAT_PATH = "/proc/stat"
# Fields of the "cpu" line that are not work: idle and iowait (proc(5)).
_IDLE_FIELDS = (3, 4)


@dataclasses.dataclass(frozen=True)
class CpuTimes:
    """Clock ticks of all cores since boot: ``busy`` of ``total``."""

    busy: int
    total: int


def host_cores() -> int:
    """The host's cores (those ``/proc/stat``'s "cpu" line adds up)."""
    return os.cpu_count() or 1


def read_cpu_times(path: str = STAT_PATH) -> CpuTimes | None:
    """The "cpu" line of ``path``, or None where there is none to read."""
    try:
        with open(path, encoding="ascii") as stat:
            first = stat.readline().split()
    except (OSError, UnicodeDecodeError):
        return None
    if len(first) < 5 or first[0] != "cpu" or not all(f.isdigit() for f in first[1:]):
        return None
    ticks = [int(f) for f in first[1:9]]  # guest times are counted in user and nice already
    idle = sum(ticks[i] for i in _IDLE_FIELDS if i < len(ticks))
    return CpuTimes(busy=sum(ticks) - idle, total=sum(ticks))


def busy_pct(before: CpuTimes | None, after: CpuTimes | None) -> float:
    """The share of the host's core time spent working between two readings; NaN unknown."""
    if before is None or after is None or after.total <= before.total:
        return math.nan
    return 100.0 * (after.busy - before.busy) / (after.total - before.total)
