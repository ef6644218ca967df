"""``stagefeed bench cluster``: two trainer workers on loopback, fed by stagefeed, against the
same two workers on synthetic device data, in one run.

Both modes are two processes of one ``MultiWorkerMirroredStrategy`` cluster (``TF_CONFIG`` on
127.0.0.1) training ``bench.keras_model``'s AlexNet with the cluster's distributed step:

- ``stagefeed``: two ``stagefeed train`` workers, each binding its own feed, and
  ``producers`` ``stagefeed produce`` processes per worker (synthetic batches from the host);
  the figure is each worker's summary ``median_ms`` (the timed steps, after the warm-up).
- ``synthetic``: two ``bench.cluster_worker`` processes whose batches are made once on the
  device: the step and the collectives alone.

The ratio ``stagefeed / synthetic`` of the medians is what feeding costs a cluster step; both
modes run in the same invocation, one after the other, on the same machine, because these
machines are noisy. Every process runs in its own process group, and every group is killed
when the mode ends, however it ends.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from stagefeed.bench.report import machine, rounded
from stagefeed.common.errors import BrokenError

log = logging.getLogger("stagefeed.bench")

WORKERS = 2
MODE_TIMEOUT_S = 900.0


def run_cluster(
    batch_size: int, image_size: int, steps: int, warmup_steps: int, producers: int
) -> dict[str, Any]:
    """Both modes; the report ``cluster_table`` prints."""
    settings = {"batch_size": batch_size, "image_size": image_size, "steps": steps,
                "warmup_steps": warmup_steps, "producers_per_worker": producers}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="stagefeed-bench-cluster-") as tmp:
        fed = _stagefeed_mode(settings, tmp)
        synthetic = _synthetic_mode(settings, tmp)
    ratio = fed["median_ms"] / synthetic["median_ms"] if synthetic["median_ms"] else None
    return {"machine": machine(), "settings": settings, "workers": WORKERS,
            "modes": {"stagefeed": fed, "synthetic": synthetic},
            "ratio": rounded(ratio, 3)}  # fmt: skip


def _tf_config(index: int, ports: Sequence[int]) -> str:
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def _ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (the OS's ephemeral choice)."""
    ports: set[int] = set()
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.add(s.getsockname()[1])
    return sorted(ports)


def _start(args: Sequence[str], log_path: str, **env: str) -> subprocess.Popen:
    with open(log_path, "w") as out:
        return subprocess.Popen(
            [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}, start_new_session=True,
        )  # fmt: skip


def _wait_all(procs: Sequence[subprocess.Popen], logs: Sequence[str], what: str) -> None:
    deadline = time.monotonic() + MODE_TIMEOUT_S
    for proc, path in zip(procs, logs, strict=True):
        try:
            code = proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late = f"{what}: a worker ran past {MODE_TIMEOUT_S:.0f} s ({path})"
            raise BrokenError(late) from None
        if code != 0:
            with open(path) as f:
                tail = f.read()[-2000:]
            raise BrokenError(f"{what}: a worker exited {code}: {tail}")


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def _stagefeed_mode(settings: dict[str, Any], tmp: str) -> dict[str, Any]:
    tf_ports, feed_ports = _ports(WORKERS), _ports(WORKERS)
    batch = ["--batch-size", str(settings["batch_size"]),
             "--image-size", str(settings["image_size"]), "--dtype", "float32"]  # fmt: skip
    trainers, producers, logs = [], [], []
    try:
        for index in range(WORKERS):
            path = os.path.join(tmp, f"fed-{index}.log")
            logs.append(path)
            trainers.append(_start(
                ["-m", "stagefeed.cli", "train", *batch, "--transport", "zmq",
                 "--model", "stagefeed.bench.keras_model:alexnet",
                 "--bind", f"tcp://127.0.0.1:{feed_ports[index]}",
                 "--steps", str(settings["steps"]),
                 "--warmup-steps", str(settings["warmup_steps"]),
                 "--progress-s", "3600", "--json", os.path.join(tmp, f"fed-{index}.json")],
                path, TF_CONFIG=_tf_config(index, tf_ports),
            ))  # fmt: skip
            for k in range(settings["producers_per_worker"]):
                producers.append(_start(
                    ["-m", "stagefeed.cli", "produce", *batch, "--transport", "zmq",
                     "--connect", f"tcp://127.0.0.1:{feed_ports[index]}", "--seed", str(k)],
                    os.path.join(tmp, f"producer-{index}-{k}.log"),
                ))  # fmt: skip
        _wait_all(trainers, logs, "stagefeed mode")
    finally:
        _kill(trainers + producers)
    medians = []
    for index in range(WORKERS):
        with open(os.path.join(tmp, f"fed-{index}.json")) as f:
            medians.append(json.load(f)["median_ms"])
    return {"median_ms": rounded(max(medians)), "per_worker_median_ms": medians}


def _synthetic_mode(settings: dict[str, Any], tmp: str) -> dict[str, Any]:
    ports = _ports(WORKERS)
    config = json.dumps({k: settings[k] for k in ("batch_size", "image_size")}
                        | {"steps": settings["steps"] + settings["warmup_steps"]})  # fmt: skip
    workers, logs = [], []
    try:
        for index in range(WORKERS):
            path = os.path.join(tmp, f"synthetic-{index}.log")
            logs.append(path)
            workers.append(_start(["-m", "stagefeed.bench.cluster_worker", config], path,
                                  TF_CONFIG=_tf_config(index, ports)))  # fmt: skip
        _wait_all(workers, logs, "synthetic mode")
    finally:
        _kill(workers)
    medians = []
    for path in logs:
        with open(path) as f:
            (line,) = [x for x in f.read().splitlines() if x.startswith("RESULT ")]
        times = json.loads(line.removeprefix("RESULT "))["step_s"][settings["warmup_steps"]:]
        medians.append(rounded(1000 * statistics.median(times)))
    return {"median_ms": rounded(max(medians)), "per_worker_median_ms": medians}


def cluster_table(report: dict[str, Any]) -> str:
    """The bench line: ms/step of each mode (the slower worker's median: a synchronous step
    waits for it) and the ratio."""
    s, fed, syn = report["settings"], report["modes"]["stagefeed"], report["modes"]["synthetic"]
    return "\n".join([
        f"bench cluster: {report['workers']} workers on loopback, AlexNet, batch "
        f"{s['batch_size']} x {s['image_size']}x{s['image_size']}x3 float32 per worker, "
        f"{s['steps']} timed steps (+{s['warmup_steps']} warm-up), "
        f"{s['producers_per_worker']} producer(s) per worker",
        "| mode | median ms/step (slower worker) | per worker | x synthetic |",
        "|---|---|---|---|",
        f"| stagefeed | {fed['median_ms']} | {fed['per_worker_median_ms']} | {report['ratio']} |",
        f"| synthetic device data | {syn['median_ms']} | {syn['per_worker_median_ms']} | 1.0 |",
    ])  # fmt: skip
