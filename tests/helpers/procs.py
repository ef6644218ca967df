"""Helpers for tests that run real stagefeed processes: trees, memory, logs, live counters."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable

import psutil
from prometheus_client.parser import text_string_to_metric_families

from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import image_schema
from tests.conftest import TINY, Started, free_tcp_port, wait_for

MIB = 2**20
# The trainer used by these tests: tiny float32 batches (1.18 MiB), a 4 MiB queue (3 batches).
BATCH_BYTES = 2 * 227 * 227 * 3 * 4 + 2 * 4
QUEUE_MB = 4
# These trainers run until stopped and test the intake, not the model: a step of known length
# at almost no CPU (tests/helpers/image_models.py, paced_fn), where AlexNet's cost 0.11 s of CPU
# and took what the load allowed; a non-finite loss must not end them (--on-nan warn).
TRAINER_FLAGS = [
    *TINY, "--model", "tests.helpers.image_models:paced_fn", "--steps", "0", "--queue-mb",
    str(QUEUE_MB), "--progress-s", "1", "--on-nan", "warn",
]  # fmt: skip


def trainer_options(max_message_mb: float = 0.0) -> TrainerOptions:
    """The options of these tests' trainers (``TINY`` batches, ``QUEUE_MB``)."""
    return TrainerOptions(
        schema=image_schema(batch_size=2), queue_mb=QUEUE_MB, max_message_mb=max_message_mb
    )


def trainer_budget_mib(producers: int, max_message_mb: float = 0.0) -> float:
    """The trainer's bound on bytes held (``TrainerOptions.held_bytes_bound``) for these
    tests' trainers, ``producers`` connected."""
    return trainer_options(max_message_mb).held_bytes_bound(producers) / MIB


def batch_threads(options: TrainerOptions) -> int:
    """Threads of a trainer that allocate batch-sized buffers: libzmq's I/O threads, which
    allocate every frame received (``min(4, enqueue_threads)`` of them: consumer/intake/intake.py,
    ``Intake.start``), and the enqueue threads (``enqueue_threads``), in which TensorFlow copies
    unaligned frames."""
    return min(4, options.enqueue_threads) + options.enqueue_threads


def allocator_allowance_mib(producers: int, max_message_mb: float = 0.0) -> float:
    """What glibc's malloc may keep, freed, of batch buffers over and above the bytes the
    trainer holds: the margin of a check on its RSS, computed from its configuration.

    The malloc policy (consumer/memory/malloc_policy.py) turns trimming off, so what malloc frees it
    keeps, and RSS stays at its high-water mark. A block freed goes back to the arena it came
    from, and an arena keeps at most the most bytes that were live in it at once (its
    fragmentation is not modelled). Each thread that allocates batch buffers
    (``batch_threads``) may have an arena of its own, and none of them holds more batch
    bytes at once than the trainer does in all (``held_bytes_bound``). So over its steady
    state the trainer's heap takes at most ``batch_threads x held_bytes_bound``: one bound for
    the bytes it holds (``trainer_budget_mib``), and this allowance,
    ``(batch_threads - 1) x held_bytes_bound``, for what the other arenas keep freed. For
    these tests' trainers (2 enqueue threads, 2 I/O threads) that is three bounds.
    """
    options = trainer_options(max_message_mb)
    return (batch_threads(options) - 1) * options.held_bytes_bound(producers) / MIB


class Spawner:
    """Starts CLI processes (each in its own process group, logging to a file in ``folder``)
    and ends every group it started at ``kill_all()``: for fixtures of any scope.

    ``kill_all`` asks first (SIGTERM to the group), then kills, so every command gets to
    clean up what it owns (sockets, summaries) when it can.
    """

    def __init__(self, folder) -> None:
        self.folder = folder
        self.started: list[Started] = []

    def __call__(self, args: list[str], name: str = "proc") -> Started:
        proc = Started(args, log_path=self.folder / f"{name}-{len(self.started)}.log")
        self.started.append(proc)
        return proc

    def kill_all(self, grace_s: float = 10.0) -> None:
        for proc in self.started:
            if proc.proc.poll() is None:
                try:
                    os.killpg(proc.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + grace_s
        for proc in self.started:
            try:
                proc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.kill_group()


def log_text(started) -> str:
    with open(started.log_path, errors="replace") as f:
        return f.read()


def wait_log(started, pattern: str, timeout: float) -> bool:
    """True once ``pattern`` (a regex) appears in the process's log; False if it exits first."""
    regex = re.compile(pattern)

    def seen() -> bool:
        return bool(regex.search(log_text(started))) or started.proc.poll() is not None

    wait_for(seen, timeout, interval=0.2)
    return bool(regex.search(log_text(started)))


class Trainer:
    """A ``stagefeed train`` process on loopback with its metrics endpoint and JSON summary."""

    def __init__(self, spawn: Spawner, *extra: str, port: int | None = None, name="trainer"):
        self.port = port or free_tcp_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.metrics_port = free_tcp_port()
        self.json_path = str(spawn.folder / f"{name}-{len(spawn.started)}.json")
        self.started = spawn(
            [
                "train",
                "--bind",
                self.endpoint,
                *TRAINER_FLAGS,
                "--metrics-port",
                str(self.metrics_port),
                "--metrics-bind",
                "127.0.0.1",
                "--metrics-producer-labels",  # the tests follow producers by id
                "--json",
                self.json_path,
                *extra,
            ],
            name=name,
        )
        assert wait_log(self.started, r"listening on tcp://", 90), log_text(self.started)

    @property
    def pid(self) -> int:
        return self.started.proc.pid

    def metrics(self) -> Metrics:
        return Metrics.scrape(self.metrics_port)

    def wait_metrics(self, predicate: Callable[[Metrics], bool], timeout: float) -> Metrics:
        """Scrape until ``predicate`` holds; return the last scrape either way."""
        last: list[Metrics] = []

        def check() -> bool:
            last[:] = [self.metrics()]
            return predicate(last[0])

        wait_for(check, timeout, interval=0.2)
        return last[0]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> dict:
        """Signal, wait, and return the JSON summary."""
        self.started.signal(sig)
        assert self.started.wait(timeout) == 0, log_text(self.started)
        with open(self.json_path) as f:
            return json.load(f)


class Metrics:
    """One scrape of the trainer's Prometheus endpoint (names in docs/observability.md)."""

    def __init__(self, samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
        self.samples = samples

    @classmethod
    def scrape(cls, port: int) -> Metrics:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(samples)

    def _by_label(self, name: str, label: str) -> dict[str, int]:
        return {dict(labels)[label]: int(v) for (n, labels), v in self.samples.items() if n == name}

    @property
    def dropped(self) -> dict[str, int]:
        return self._by_label("stagefeed_dropped_messages_total", "reason")

    @property
    def received(self) -> dict[str, int]:
        return self._by_label("stagefeed_received_batches_total", "producer")

    @property
    def trained(self) -> dict[str, int]:
        return self._by_label("stagefeed_trained_batches_total", "producer")

    @property
    def missing(self) -> dict[str, int]:
        return self._by_label("stagefeed_sequence_missing_batches", "producer")

    @property
    def heap_free_mib(self) -> float:
        return self.samples[("stagefeed_heap_free_bytes", ())] / MIB


def producer_ids_of(worker_pid: int, names: Iterable[str]) -> list[str]:
    """Producer ids (``host-PID-INDEX-NONCE``) that belong to the worker process ``worker_pid``."""
    return [n for n in names if re.fullmatch(rf".+-{worker_pid}-\d+-[0-9a-f]{{4}}( key \S+)?", n)]


def workers_of(started, count: int, timeout: float = 60) -> list[psutil.Process]:
    """The spawned producer processes of a ``stagefeed produce`` supervisor.

    A worker is a child that multiprocessing's spawn started (``--multiprocessing-fork`` on its
    command line), not its resource tracker: told apart by what they are, since a child that
    was forked but has not exec'd yet still shows its parent's command line. The list returned
    is the one that had ``count`` workers.
    """
    parent = psutil.Process(started.proc.pid)
    seen: list[psutil.Process] = []

    def workers() -> list[psutil.Process]:
        found = []
        for child in parent.children():
            try:
                if "--multiprocessing-fork" in child.cmdline():
                    found.append(child)
            except psutil.NoSuchProcess:
                continue
        seen[:] = found
        return found

    assert wait_for(lambda: len(workers()) == count, timeout), [p.cmdline() for p in seen]
    return list(seen)


def steps_of(m: Metrics) -> int:
    """Train steps the trainer has run (``stagefeed_steps_total``)."""
    return int(m.samples.get(("stagefeed_steps_total", ()), 0))


def disconnections_of(m: Metrics) -> int:
    """Connections the trainer has seen go (``stagefeed_connection_events_total``)."""
    key = ("stagefeed_connection_events_total", (("event", "disconnected"),))
    return int(m.samples.get(key, 0))


class PeakRss:
    """A trainer's peak RSS since ``reset()``: the kernel's VmHWM, reset through clear_refs.

    A train step's working set comes and goes, so peaks are compared with peaks over whole
    steps: a window is ``WINDOW_STEPS`` steps the trainer ran after the reset, counted by its
    ``stagefeed_steps_total``. (A window of 2 s missed a step's working set whenever a step
    took longer, as it can on a loaded machine.)
    """

    WINDOW_STEPS = 3
    WINDOW_TIMEOUT_S = 120.0

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.pid = trainer.pid
        self.steps_at_reset = steps_of(trainer.metrics())

    def _status(self, key: str) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) / 1024

    def reset(self) -> None:
        """Reset the high-water mark to the current RSS."""
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")
        self.steps_at_reset = steps_of(self.trainer.metrics())

    def peak_mib(self, window: bool = False) -> float:
        """The peak since ``reset()``; ``window``: once ``WINDOW_STEPS`` whole steps ran since
        it (the step under way at the reset, and any that ended before the count was read,
        do not count)."""
        if window:
            want = self.steps_at_reset + self.WINDOW_STEPS + 1
            m = self.trainer.wait_metrics(lambda m: steps_of(m) >= want, self.WINDOW_TIMEOUT_S)
            assert steps_of(m) >= want, (
                f"the trainer ran {steps_of(m) - self.steps_at_reset} steps in "
                f"{self.WINDOW_TIMEOUT_S:.0f} s, not the {self.WINDOW_STEPS} + 1 of a window"
            )
        return self._status("VmHWM")

    def steady(self) -> float:
        """The peak over one window of steady training."""
        self.reset()
        return self.peak_mib(window=True)

    def settled(self, timeout: float = 30.0) -> float:
        """The steady peak once it stops creeping up (TensorFlow warms up for a few steps)."""
        deadline = time.monotonic() + timeout
        last = self.steady()
        while time.monotonic() < deadline:
            now = self.steady()
            if now <= last + 2:
                return max(now, last)
            last = now
        return last


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MIB


def family(started) -> list[psutil.Process]:
    """The process, its descendants, and anything else in its process group."""
    root = psutil.Process(started.proc.pid)
    procs = {root.pid: root}
    for child in root.children(recursive=True):
        procs[child.pid] = child
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == root.pid:
                procs[proc.pid] = proc
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return list(procs.values())


def shm_paths(procs: Iterable[psutil.Process]) -> set[str]:
    """Shared-memory files (/dev/shm) the processes map or hold open.

    Whatever they are (multiprocessing's named semaphores ``sem.mp-*`` before the producer
    pool shared pipes instead), none may outlive the processes; files already unlinked are
    listed too and never exist.
    """
    paths = set()
    for proc in procs:
        try:
            maps = [m.path for m in proc.memory_maps(grouped=True)]
            files = [f.path for f in proc.open_files()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        paths.update(p for p in maps + files if p.startswith("/dev/shm/"))
    return paths


def gone_within(procs: Iterable[psutil.Process], timeout: float) -> tuple[bool, float]:
    """Wait until every process has exited; (all gone, seconds it took)."""
    began = time.monotonic()
    procs = list(procs)

    def all_gone() -> bool:
        return not any(_alive(p) for p in procs)

    ok = wait_for(all_gone, timeout, interval=0.05)
    return ok, time.monotonic() - began


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
