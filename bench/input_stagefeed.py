"""``bench input``'s stagefeed mode: the real ``stagefeed run``, as a user types it.

``stagefeed run --source images:DIR --transform bench_input_augment:transform --model
stagefeed.bench.input_keras:build --producers N --transport shm|zmq ...`` in a child process
whose working directory holds the transform module (``input_data.write_transform``). Its
``--json`` summary gives images/s over its timed steps (``examples_per_s``: the monitor's
window from the last warm-up step to the end). The CPU its process tree (trainer and
producers) used in that window is read here: at every progress line (``--progress-s``) the
tree's CPU is sampled (``bench.cpu.TreeCpu``: the tree listed once a second, since a listing
reads every process of the host on the cores the run uses), and the figure is the CPU
between the first line at or after the warm-up and the last line, over the images trained
between them. The lines are read here,
so a sample is as late as this process's reading: on cores the run saturates, lines come in
bursts, and a burst read in one go samples the same CPU for every line of it (a window of no
CPU). A window whose lines were read in less than half the time its steps took (the run's own
images/s says how long) is such a burst: its CPU is not measured (None, "n/a" in the table),
never a made-up figure.

Buffers are a few batches deep (``--queue-batches``, ``--inflight-mb``: one batch per
producer), like the peers' prefetch buffers, so the warm-up drains what the producers made
while TensorFlow started, and the timed steps measure the steady state, not a backlog.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from stagefeed.bench.cpu import TreeCpu
from stagefeed.bench.input_config import InputConfig
from stagefeed.common.errors import BrokenError, ClosedError
from stagefeed.common.options import MIB

log = logging.getLogger(__name__)

MODEL = "stagefeed.bench.input_keras:build"
PROGRESS_S = 0.05  # a line (and a CPU sample) per 50 ms: a short timed window gets several
QUEUE_BATCHES = 4
RUN_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 20.0
_PROGRESS = re.compile(r"stagefeed\.progress: step (\d+)/")
# ``bench input --transports``' names and ``run --transport``'s (tcp is ZeroMQ over tcp).
RUN_TRANSPORT = {"shm": "shm", "tcp": "zmq"}


def run_command(config: InputConfig, folder: str, transform: str, producers: int,
                transport: str, json_path: str) -> list[str]:  # fmt: skip
    """The ``stagefeed run`` command line of one measurement."""
    batch_mb = config.batch_size * config.crop * config.crop * 3 / MIB
    epochs = -(-config.total_steps // config.batches_per_epoch) + 1
    return [
        sys.executable, "-m", "stagefeed.cli", "run",
        "--source", f"images:{folder}", "--transform", transform, "--model", MODEL,
        "--producers", str(producers), "--transport", RUN_TRANSPORT[transport],
        "--batch-size", str(config.batch_size), "--short-batch", "drop",
        "--seed", str(config.seed), "--epochs", str(epochs),
        "--steps", str(config.steps), "--warmup-steps", str(config.warmup_steps),
        "--queue-batches", str(QUEUE_BATCHES), "--inflight-mb", f"{batch_mb * 1.01:.3f}",
        "--device", "cpu", "--progress-s", str(PROGRESS_S), "--log-level", "info",
        "--json", json_path,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    """This environment without ``STAGEFEED_*`` (the command line says everything)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFEED_")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Progress(threading.Thread):
    """Reads the run's log; at each progress line notes ``(step, when read, tree CPU s)``;
    keeps the last lines for an error message."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(name="bench-input-progress", daemon=True)
        self.proc = proc
        self.marks: list[tuple[int, float, float | None]] = []
        self.tail: list[str] = []
        self.cpu = TreeCpu(proc.pid)

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = _PROGRESS.search(line)
            if match:
                step, now = int(match.group(1)), time.monotonic()
                self.marks.append((step, now, self.cpu()))
            self.tail = [*self.tail[-19:], line.rstrip()]


def window_cpu(
    marks: list[tuple[int, float, float | None]], warmup: int, batch_size: int,
    images_per_s: float,
) -> tuple[float | None, int]:
    """CPU seconds between the first mark at or after ``warmup`` steps and the last mark,
    and the images trained between them; ``(None, 0)`` without two such marks, or when they
    were read in a burst (in less than half the time their steps took at ``images_per_s``:
    the module docstring)."""
    timed = [(step, at, cpu) for step, at, cpu in marks if step >= warmup and cpu is not None]
    if len(timed) < 2 or timed[-1][0] <= timed[0][0] or images_per_s <= 0:
        return None, 0
    (first_step, first_at, first_cpu), (last_step, last_at, last_cpu) = timed[0], timed[-1]
    images = (last_step - first_step) * batch_size
    if last_at - first_at < 0.5 * images / images_per_s:
        return None, 0
    return last_cpu - first_cpu, images  # type: ignore[operator]


def measure_run(
    config: InputConfig, root: str, folder: str, transform: str, producers: int,
    transport: str, stop: threading.Event,
) -> dict[str, Any]:  # fmt: skip
    """One ``stagefeed run``; its figures. ``ClosedError`` if ``stop`` was set meanwhile."""
    json_path = os.path.join(root, f"run-{transport}-{producers}.json")
    command = run_command(config, folder, transform, producers, transport, json_path)
    log.info("stagefeed: %s", " ".join(command[2:]))
    proc = subprocess.Popen(
        command, cwd=root, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    reader = _Progress(proc)
    reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while proc.poll() is None:
            if stop.is_set():
                raise ClosedError("stop requested")
            if time.monotonic() > deadline:
                raise BrokenError(f"stagefeed run gave no result within {RUN_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: the run stops its producers and ends
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its session: run and its producers
                proc.wait()
        reader.join(STOP_TIMEOUT_S)
    if proc.returncode != 0:
        raise BrokenError(
            f"stagefeed run ({transport}, {producers} producers) exited {proc.returncode}: "
            + " | ".join(reader.tail[-5:])
        )
    with open(json_path, encoding="utf-8") as f:
        summary = json.load(f)
    images_per_s = summary["examples_per_s"]
    cpu, cpu_images = window_cpu(reader.marks, config.warmup_steps, config.batch_size,
                                 images_per_s or 0.0)  # fmt: skip
    return {
        "images_per_s": images_per_s,
        "seconds": config.steps * config.batch_size / images_per_s if images_per_s else None,
        "images": config.steps * config.batch_size,
        "cpu_s": cpu,
        "cpu_images": cpu_images,
        "stall_pct": summary["stall_pct"],
        "run_transport": summary["transport"],
        "steps": summary["steps"],
        "command": "stagefeed " + " ".join(command[3:]),
    }
