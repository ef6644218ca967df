"""CPU seconds read from /proc (Linux): what a feed path costs, measured next to the step.

On a machine where the trainer computes on the same cores (CPU-only), every core-second the
feed path spends is taken from the step; these figures say how many. ``None`` where /proc
is not available.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterable

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_cpu_s(path: str) -> float | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    # Fields after "(comm)": state is field 3, utime field 14, stime field 15 (1-based).
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def process_cpu_s(pid: int | str = "self") -> float | None:
    """User + system CPU seconds of a process (all its threads); None if unreadable."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def threads_cpu_s(
    name_prefixes: tuple[str, ...] = (), comm_prefixes: tuple[str, ...] = ()
) -> float | None:
    """CPU seconds of this process's threads: Python threads whose name starts with one of
    ``name_prefixes``, plus native threads (e.g. ZeroMQ's ``ZMQbg/IO/0``) whose kernel name
    starts with one of ``comm_prefixes``."""
    if not os.path.isdir("/proc/self/task"):
        return None
    wanted = {
        t.native_id for t in threading.enumerate() if t.name.startswith(name_prefixes or ("\0",))
    }
    total = 0.0
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/comm", encoding="utf-8", errors="replace") as f:
                comm = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        if int(os.path.basename(task)) in wanted or (
            comm_prefixes and comm.startswith(comm_prefixes)
        ):
            total += _stat_cpu_s(f"{task}/stat") or 0.0
    return total


def sum_cpu_s(values: Iterable[float | None]) -> float | None:
    """Sum, or None if any part is unknown."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]
