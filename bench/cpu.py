"""CPU seconds of processes and threads (psutil): what a feed path costs, next to the step.

On a machine where the trainer computes on the same cores (CPU-only), every core-second the
feed path spends is taken from the step; these figures say how many. ``None`` where the
figure cannot be read (a process that is gone, a platform without per-thread times).

psutil is a dev extra, not a dependency of the trainer's install: without it ``bench steps``
stops at once and says what to install (``stagefeed.bench.cli``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

try:
    import psutil
except ImportError as exc:
    raise ImportError(
        "stagefeed bench steps reads CPU time with psutil, which is not installed: "
        "pip install psutil (or install stagefeed with the dev extra: pip install -e '.[dev]')",
        name="psutil",
    ) from exc


def process_cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process (all its threads; this one if ``pid`` is None);
    None if it cannot be read."""
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return times.user + times.system


def _kernel_name(tid: int) -> str | None:
    """A thread's kernel name (``comm``), e.g. ZeroMQ's ``ZMQbg/IO/0``: psutil has no thread
    names, so this one file is read directly (Linux)."""
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None  # the thread ended meanwhile, or no /proc


def threads_cpu_s(
    name_prefixes: tuple[str, ...] = (), comm_prefixes: tuple[str, ...] = ()
) -> float | None:
    """CPU seconds of this process's threads: Python threads whose name starts with one of
    ``name_prefixes``, plus native threads (e.g. ZeroMQ's ``ZMQbg/IO/0``) whose kernel name
    starts with one of ``comm_prefixes``. None where per-thread times cannot be read."""
    try:
        threads = psutil.Process().threads()
    except (psutil.Error, OSError):
        return None
    wanted = {
        t.native_id for t in threading.enumerate() if t.name.startswith(name_prefixes or ("\0",))
    }
    total = 0.0
    for thread in threads:
        if thread.id in wanted or (
            comm_prefixes and (_kernel_name(thread.id) or "").startswith(comm_prefixes)
        ):
            total += thread.user_time + thread.system_time
    return total


def sum_cpu_s(values: Iterable[float | None]) -> float | None:
    """Sum, or None if any part is unknown."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]


def tree_cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process and every descendant alive now, plus what the
    ones they already waited for used (their ``children_*`` times); None if the root cannot
    be read. A descendant that ends between the listing and its reading is left out."""
    tree = _tree(pid)
    return None if tree is None else _tree_total(tree)


class TreeCpu:
    """``tree_cpu_s`` of one process, read often (at every progress line of a run): the tree
    is listed again only every ``relist_s``. Listing the descendants reads every process of
    the host (psutil's ppid map, milliseconds on a busy host), on the cores the measured run
    uses; reading a listed process is one ``/proc`` file. A descendant started since the last
    listing is counted from the next one; one waited for is in its parent's ``children_*``."""

    def __init__(self, pid: int, relist_s: float = 1.0) -> None:
        self.pid = pid
        self.relist_s = relist_s
        self._tree: list[psutil.Process] | None = None
        self.listed_at = 0.0  # monotonic time of the last listing

    def __call__(self) -> float | None:
        now = time.monotonic()
        if self._tree is None or now - self.listed_at >= self.relist_s:
            self._tree, self.listed_at = _tree(self.pid), now
        return None if self._tree is None else _tree_total(self._tree)


def _tree(pid: int | None) -> list[psutil.Process] | None:
    """A process and its descendants alive now (the root first); None if it cannot be read."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except (psutil.Error, OSError):
        return None


def _tree_total(tree: list[psutil.Process]) -> float | None:
    """CPU seconds of ``tree`` (``tree_cpu_s``); None if its root cannot be read."""
    total = 0.0
    for process in tree:
        try:
            times = process.cpu_times()
        except (psutil.Error, OSError):
            if process is tree[0]:
                return None
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total
