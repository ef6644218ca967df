"""Two ``tests.helpers.cluster_child`` processes of one loopback cluster, and the one-process
reference they must match: what tests/test_cluster_loop.py and tests/test_cluster_runs.py
start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, free_tcp_port

RUN_TIMEOUT_S = 150  # two TensorFlow processes on two shared cores


def results_in(output: str) -> list[dict]:
    """The ``RESULT {json}`` lines a ``cluster_child`` printed, one per run, in order."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return [json.loads(line.removeprefix("RESULT ")) for line in lines]


class Workers:
    """Two ``tests.helpers.cluster_child`` processes of one cluster, each in its own process
    group; ``settings`` are each worker's (``runs`` and the cluster's own settings)."""

    def __init__(self, folder: Path, settings: list[dict]) -> None:
        ports: set[int] = set()
        while len(ports) < 2:
            ports.add(free_tcp_port())
        cluster = {"worker": [f"127.0.0.1:{port}" for port in sorted(ports)]}
        self.logs = [folder / f"worker-{i}.log" for i in range(2)]
        self.procs = []
        for index, (setting, path) in enumerate(zip(settings, self.logs, strict=True)):
            config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            with open(path, "w") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.helpers.cluster_child", json.dumps(setting)],
                    stdout=log, stderr=subprocess.STDOUT, env=cli_env(TF_CONFIG=config),
                    cwd=REPO, start_new_session=True,
                ))  # fmt: skip

    def output(self, index: int) -> str:
        return self.logs[index].read_text()

    def steps_printed(self, index: int) -> int:
        return self.output(index).count("\nSTEP ")

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> list[tuple[int, list[dict]]]:
        """Each worker's exit code and the results of its runs, in order; fails (the caller
        kills them) if one hangs or printed no result."""
        deadline = time.monotonic() + timeout
        done = []
        for index, proc in enumerate(self.procs):
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {index} still running after {timeout} s:\n"
                            f"{self.output(index)[-3000:]}")  # fmt: skip
            results = results_in(self.output(index))
            assert results, f"worker {index} exit {code}, no result:\n{self.output(index)[-3000:]}"
            done.append((code, results))
        return done

    def kill(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)


def references(runs: list[dict]) -> list[dict]:
    """The figures of ``runs`` trained by one process without a strategy, on every worker's
    batches put together, one run after the other."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.cluster_child",
         json.dumps({"runs": runs, "reference": True})],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=cli_env(), cwd=REPO,
        check=False,
    )  # fmt: skip
    results = results_in(done.stdout)
    assert done.returncode == 0 and len(results) == len(runs), done.stderr[-3000:]
    return results
