"""How a user runs each path of the matrix: the same commands, round after round.

A ``PathRun`` starts a column's trainer side (``run``; ``train``; two cluster workers; the
user's program of ``tests/matrix/feed_user.py``) and, where a user runs them apart, its
``stagefeed produce`` commands, which keep running across the trainer's restarts as a user's
would (they rewind when the next trainer welcomes them). Signals go to the trainer side's
processes from outside, as ``kill`` sends them; kill -9 goes to their process groups.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import psutil

from tests.conftest import REPO, Started, cli_env, free_tcp_port, wait_for
from tests.helpers import procs
from tests.matrix import data
from tests.matrix.grid import Column
from tests.test_cluster_cli import cluster_config, distinct_ports

SCHEMA = "tests.matrix.data:SCHEMA"
# The paths ``PathRun`` starts: the columns of tests/matrix/grid.py.
RUNNERS = ("graph_run", "keras_run", "train_produce", "feed_fit", "feed_loop", "cluster")
CHECKPOINT_EVERY = 4
MODELS = {"graph_run": "tests.matrix.data:graph_counter"}
KERAS = "tests.matrix.data:keras_counter"
TIMEOUT_S = 240  # TensorFlow processes on two shared cores
TF_LOADED = r"TensorFlow \S+ loaded in"
# A line's time, as every stagefeed log line and the user program's start with it.
STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)", re.M)


class UserProgram(Started):
    """``python -m tests.matrix.feed_user ARGS``: the user's own program on ServedFeed."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.env = env
        self._log = open(log_path, "w+")  # noqa: SIM115
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.matrix.feed_user", *args],
            stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
            start_new_session=True,
        )  # fmt: skip


class PathRun:
    """One column's processes. ``start`` begins a round (the trainer side, and the producers
    when none runs); ``stop``/``kill`` end the trainer side; ``finish`` waits for the end."""

    def __init__(self, column: Column, tmp_path: Path) -> None:
        assert column.path in RUNNERS, f"no runner for the path {column.path!r}"
        self.column = column
        self.tmp = tmp_path
        self.save = tmp_path / "save"
        self.env = cli_env(STAGEFEED_MATRIX_SPEED=column.speed)
        self.trainers: list[Started] = []
        self.producers: list[Started] = []
        self.started: list[Started] = []
        self.round = ""
        # Producers in all (a cluster's split between its workers); the elastic round changes it.
        self.producer_count = 2
        workers = 2 if column.path == "cluster" else 1
        self.feeds = [f"tcp://127.0.0.1:{p}" for p in distinct_ports(workers)]

    # -- starting ------------------------------------------------------------------------
    def _start(self, args: list[str], name: str, env: dict[str, str] | None = None) -> Started:
        log = self.tmp / f"{self.round}-{name}.log"
        if self.column.path.startswith("feed_") and name.startswith("trainer"):
            proc: Started = UserProgram(args, env or self.env, log)
        else:
            proc = Started(args, env=env or self.env, log_path=log)
        self.started.append(proc)
        return proc

    def _transport(self) -> str:
        return "shm" if self.column.transport == "shm" else "zmq"

    def trainer_args(self, source: str, model: str | None) -> list[str]:
        path = self.column.path
        common = ["--schema", SCHEMA, "--save", str(self.save), "--epochs", str(data.PASSES),
                  "--warmup-steps", "0", "--progress-s", "2", "--queue-mb", "1",
                  "--checkpoint-every", str(CHECKPOINT_EVERY)]  # fmt: skip
        if path in ("graph_run", "keras_run"):
            return ["run", "--producers", str(self.producer_count),
                    "--transport", self._transport(),
                    "--source", f"tests.matrix.data:{source}",
                    "--model", model or MODELS.get(path, KERAS), *common,
                    "--json", str(self.tmp / f"{self.round}.json")]  # fmt: skip
        if path == "train_produce":
            return ["train", "--bind", self.feeds[0], "--transport", self._transport(),
                    "--shm-producers", "3", "--model", model or KERAS, *common,
                    "--json", str(self.tmp / f"{self.round}.json")]  # fmt: skip
        raise AssertionError(path)

    def start(self, round_name: str, *, source: str = "rows", model: str | None = None,
              producers_after_s: float = 0.0) -> None:  # fmt: skip
        """Start the trainer side; then, after ``producers_after_s`` (the trainer waits for
        data meanwhile), the producers, unless they still run from an earlier round."""
        self.round = round_name
        path = self.column.path
        if path == "cluster":
            ports = distinct_ports(2)
            self.trainers = [
                self._start(["train", "--bind", self.feeds[i], "--transport", "auto",
                             "--model", model or KERAS, "--schema", SCHEMA,
                             "--save", str(self.tmp / f"save-{i}"), "--steps", "0",
                             "--warmup-steps", "0", "--progress-s", "2",
                             "--queue-mb", "1", "--checkpoint-every", str(CHECKPOINT_EVERY),
                             "--shm-producers", "2",
                             "--producer-timeout-s", "4", "--cluster-join-timeout-s", "20",
                             "--json", str(self.tmp / f"{round_name}-{i}.json")],
                            f"trainer-{i}", cli_env(STAGEFEED_MATRIX_SPEED=self.column.speed,
                                                    TF_CONFIG=cluster_config(i, ports)))
                for i in range(2)
            ]  # fmt: skip
            self.save = self.tmp / "save-0"
        elif path.startswith("feed_"):
            self.trainers = [self._start(
                ["--mode", path.removeprefix("feed_"), "--bind", self.feeds[0],
                 "--transport", self._transport(), "--save", str(self.save)], "trainer")]
        else:
            self.trainers = [self._start(self.trainer_args(source, model), "trainer")]
        if path in ("graph_run", "keras_run"):
            return
        if producers_after_s:
            time.sleep(producers_after_s)
        if path == "cluster" and source == "rows":
            source = "rows_stream"  # a cluster refuses sources with passes (docs/resume.md)
        if not any(p.proc.poll() is None for p in self.producers):
            self.producers = [self._producer(g, source) for g in range(len(self.feeds))]

    def _producer(self, group: int, source: str) -> Started:
        groups = len(self.feeds)
        workers = self.producer_count // groups
        return self._start(
            ["produce", "--connect", self.feeds[group], "--workers", str(workers),
             "--shard-group", f"{group}/{groups}", "--transport", self._transport(),
             "--schema", SCHEMA, "--source", f"tests.matrix.data:{source}"],
            f"producer-{group}",
        )  # fmt: skip

    # -- watching ------------------------------------------------------------------------
    def log(self, index: int = 0) -> str:
        return procs.log_text(self.trainers[index])

    def wait_line(self, pattern: str, timeout: float = TIMEOUT_S) -> bool:
        return procs.wait_log(self.trainers[0], pattern, timeout)

    def wait_checkpoint(self) -> None:
        """Until the chief wrote a checkpoint in this round."""
        assert self.wait_line(r"step \d+: (checkpoint|trained)"), self.log()[-4000:]

    # -- ending --------------------------------------------------------------------------
    def signal(self, sig: int) -> float:
        for proc in self.trainers:
            if proc.proc.poll() is None:
                os.kill(proc.proc.pid, sig)
        return time.monotonic()

    def kill(self) -> None:
        """kill -9 of the trainer side (``run``: its producers too, they are its children)."""
        for proc in self.trainers:
            proc.kill_group()

    def wait_trainers(self, timeout: float = TIMEOUT_S) -> list[int]:
        codes = []
        for proc in self.trainers:
            try:
                codes.append(proc.wait(timeout))
            except Exception as e:  # noqa: BLE001 (the message names the process)
                raise AssertionError(f"{proc.log_path} still running: {e}") from e
        return codes

    def kill_producers(self) -> None:
        """kill -9 of the separate producers (a user restarting them with another count)."""
        for proc in self.producers:
            proc.kill_group()
        self.producers = []

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.proc.poll() is None:
                proc.kill_group()

    # -- reading -------------------------------------------------------------------------
    def counts(self) -> np.ndarray:
        path = self.column.path
        if path == "graph_run":
            return data.graph_counts(str(self.save / "model.ckpt"))
        if path.startswith("feed_"):
            return np.load(self.save / "counts.npy")
        return data.keras_counts(str(self.save / "model.keras"))

    def summary(self, index: int = 0) -> dict:
        suffix = f"-{index}" if self.column.path == "cluster" else ""
        return json.loads((self.tmp / f"{self.round}{suffix}.json").read_text())


def leftovers(pids: list[int]) -> list[str]:
    """What the processes ``pids`` (ended) left: a live process, an ipc socket file, a
    shared-memory folder named after them."""
    left = []
    for pid in pids:
        if psutil.pid_exists(pid):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(f"process {pid}")
            except psutil.NoSuchProcess:
                pass
        for path in (f"/tmp/stagefeed-{pid}.sock", f"/tmp/stagefeed-shm-{pid}"):
            if os.path.exists(path):
                left.append(path)
    return left


def family_pids(run: PathRun) -> list[int]:
    """Every process of the trainer side and the producers, now (children included)."""
    pids = []
    for started in run.started:
        if started.proc.poll() is None:
            pids.extend(p.pid for p in procs.family(started))
        pids.append(started.proc.pid)
    return sorted(set(pids))


def max_gap_s(log: str, after: str = TF_LOADED) -> float:
    """The longest time between two consecutive log lines after ``after`` matched."""
    found = re.search(after, log)
    stamps = [
        int(h) * 3600 + int(m) * 60 + int(s)
        for h, m, s in STAMP.findall(log[found.start() if found else 0 :])
    ]
    gaps = [(b - a) % 86400 for a, b in zip(stamps, stamps[1:], strict=False)]
    return float(max(gaps, default=0))


def free_port() -> int:
    return free_tcp_port()


def wait_gone(pids: list[int], timeout: float) -> bool:
    return wait_for(lambda: not any(_alive(p) for p in pids), timeout, interval=0.1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


STOP_SIGNALS = {"stop_sigint": signal.SIGINT, "stop_sigterm": signal.SIGTERM}
