"""Helpers for shared-memory tests with real processes: the canary trainer, memfds in /proc.

``CanaryTrainer`` is ``python -m tests.helpers.shm_canary trainer`` (``stagefeed train`` with the
canary schema and model, ``--transport shm``) on a loopback port, with its Prometheus
endpoint and JSON summary, started through a ``procs.Spawner`` so teardown ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

from tests.conftest import REPO, Started, cli_env, free_tcp_port
from tests.helpers import procs

MEMFD = "/memfd:stagefeed-"


class ModuleStarted(Started):
    """A ``Started`` running ``python -m MODULE ARGS`` instead of the stagefeed CLI."""

    def __init__(self, module: str, args: Sequence[str], log_path, env: dict[str, str] | None):
        self.log_path = log_path
        self.env = env
        self._log = open(log_path, "w+")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=self._log, stderr=subprocess.STDOUT,
            text=True, env=env or cli_env(), cwd=REPO, start_new_session=True,
        )  # fmt: skip


def start_module(spawn: procs.Spawner, module: str, args: Sequence[str], name: str, env=None):
    started = ModuleStarted(module, args, spawn.folder / f"{name}-{len(spawn.started)}.log", env)
    spawn.started.append(started)
    return started


def produce(spawn: procs.Spawner, endpoint: str, *extra: str, name: str, env=None) -> Started:
    """``stagefeed produce`` over shared memory from the canary source (schema adopted)."""
    args = ["produce", "--connect", endpoint, "--transport", "shm"]
    args += ["--source", "tests.helpers.shm_canary:source", *extra]
    started = Started(args, env=env, log_path=spawn.folder / f"{name}-{len(spawn.started)}.log")
    spawn.started.append(started)
    return started


class CanaryTrainer:
    def __init__(
        self, spawn: procs.Spawner, *extra: str, port: int | None = None,
        socket: str | None = None, name: str = "trainer",
    ) -> None:  # fmt: skip
        self.port = port or free_tcp_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.metrics_port = free_tcp_port()
        while self.metrics_port == self.port:  # a restarted trainer reuses a freed port
            self.metrics_port = free_tcp_port()
        self.socket = socket or str(spawn.folder / "sock" / "pools.sock")
        self.json_path = str(spawn.folder / f"{name}-{len(spawn.started)}.json")
        args = ["trainer", "--bind", self.endpoint, "--steps", "0", "--queue-mb", "1"]
        args += ["--shm-socket", self.socket, "--json", self.json_path, "--progress-s", "1"]
        args += ["--metrics-port", str(self.metrics_port), "--metrics-bind", "127.0.0.1"]
        args += ["--metrics-producer-labels"]  # the tests follow producers by id
        self.started = start_module(spawn, "tests.helpers.shm_canary", [*args, *extra], name)
        assert procs.wait_log(self.started, r"listening on tcp://", 90), self.log()

    @property
    def pid(self) -> int:
        return self.started.proc.pid

    def log(self) -> str:
        return procs.log_text(self.started)

    def metrics(self) -> procs.Metrics:
        return procs.Metrics.scrape(self.metrics_port)

    def wait_metrics(self, predicate: Callable[[procs.Metrics], bool], timeout: float = 90):
        last: list[procs.Metrics] = []

        def check() -> bool:
            last[:] = [self.metrics()]
            return predicate(last[0])

        from tests.conftest import wait_for

        wait_for(check, timeout, interval=0.2)
        return last[0]

    def trained_of(self, worker_pid: int, at_least: int, timeout: float = 90) -> int:
        """Batches of ``worker_pid``'s producer trained, once at least ``at_least``."""

        def count(m: procs.Metrics) -> int:
            return sum(m.trained[p] for p in procs.producer_ids_of(worker_pid, m.trained))

        live = self.wait_metrics(lambda m: count(m) >= at_least, timeout)
        assert count(live) >= at_least, f"{worker_pid}: {live.trained}\n{self.log()[-3000:]}"
        return count(live)

    def stop(self, timeout: float = 60) -> dict:
        self.started.signal(signal.SIGTERM)
        assert self.started.wait(timeout) == 0, self.log()[-3000:]
        with open(self.json_path) as f:
            return json.load(f)


def memfd_links(pid: int) -> dict[str, str]:
    """``/proc/PID/fd/N`` -> memfd name, for each stagefeed pool the process holds open."""
    links = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(MEMFD):
            links[f"/proc/{pid}/fd/{fd}"] = target.split(" ")[0]
    return links


def memfds(pid: int) -> dict[str, set[str]]:
    """The process's stagefeed pools: memfd names it holds open (``fds``) and maps (``maps``)."""
    fds, maps = set(memfd_links(pid).values()), set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[5].strip() if len(line.split()) > 5 else ""
            if path.startswith(MEMFD):
                maps.add(path.split(" ")[0])
    return {"fds": fds, "maps": maps}
