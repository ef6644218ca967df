"""Shared memory end to end, real processes and sockets: ``stagefeed run --transport shm``, a
trainer taking shared-memory and CURVE tcp producers at once, and the content canary through
TensorFlow (zero corrupted batches; the same check fails when slots are released early).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from stagefeed.common.shm.sizing import pool_slots
from stagefeed.keygen import write_keys
from tests.conftest import REPO, TINY, cli_env, free_tcp_port, run_cli
from tests.helpers import procs

pytestmark = pytest.mark.slow  # TensorFlow in a subprocess

WAIT_S = 120


def dev_shm() -> set[str]:
    """/dev/shm entries other than multiprocessing's named semaphores (other jobs' locks)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.mp-")}


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_run_over_shared_memory_accounts_for_every_batch_and_leaves_nothing(tmp_path, transport):
    before = dev_shm()
    path = tmp_path / "run.json"
    done = run_cli(
        ["run", *TINY, "--steps", "4", "--producers", "2", "--queue-mb", "8"]
        + ["--transport", transport, "--json", str(path)],
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"transport shm\+ipc, endpoint ipc://\S+; shared-memory pools", done.stdout)
    summary = json.loads(path.read_text())
    assert summary["transport"] == "shm+ipc"
    shm, batches = summary["shm"], summary["batches"]
    # Sized from the queue budget: 8 MiB / 1.18 MiB = 6 batches, staging 2, credit 2, for 2.
    assert summary["queue_capacity"] == 6
    assert shm["slots_per_pool"] == pool_slots(6, 2, 2, 2) == 8
    assert shm["pool_mb"] == pytest.approx(8 * shm["slot_mb"], abs=0.1)
    assert shm["pools_accepted"] == 2 and shm["sized_for_producers"] == 2
    assert shm["batches"] == batches["received"] > 0  # every batch by shared memory
    assert batches["trained"] == 6 and batches["dropped"] == 0
    assert batches["received"] == (
        batches["trained"] + batches["queued_at_stop"] + batches["not_enqueued"]
    )
    assert summary["loss_first"] is not None  # AlexNet on batches of 2 may diverge later
    # Nothing left: no producer, no socket or its directory, no /dev/shm file.
    pids = [int(name.rsplit("-", 3)[1]) for name in summary["producers"]]
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    assert not os.path.lexists(shm["socket"])
    assert not os.path.lexists(os.path.dirname(shm["socket"]))
    assert not os.path.exists(summary["endpoint"].removeprefix("ipc://"))
    assert dev_shm() <= before
    assert "Traceback" not in done.stderr


def test_one_trainer_takes_shared_memory_and_curve_tcp_producers_at_once(spawn, tmp_path):
    keys = str(tmp_path / "keys")
    write_keys(keys, 2)
    sock = str(tmp_path / "sock" / "pools.sock")
    trainer = procs.Trainer(
        spawn, "--curve-keys", keys, "--transport", "shm", "--shm-socket", sock
    )
    produce = ["produce", "--connect", trainer.endpoint, *TINY, "--rate", "4"]
    local = spawn(
        [*produce, "--transport", "shm", "--curve-keys", os.path.join(keys, "client-0")],
        name="shm",
    )
    remote = spawn(  # as a producer on another host would: tcp with CURVE, no shared memory
        [*produce, "--transport", "zmq", "--curve-keys", os.path.join(keys, "client-1")],
        name="tcp",
    )
    live = trainer.wait_metrics(
        lambda m: len(m.trained) == 2 and min(m.trained.values()) >= 3, WAIT_S
    )
    assert len(live.trained) == 2 and min(live.trained.values()) >= 3, live.trained
    summary = trainer.stop()
    for proc in (local, remote):
        proc.signal(signal.SIGTERM)
        assert proc.wait(30) == 0, procs.log_text(proc)
    shm, received = summary["shm"], summary["batches"]["received"]
    assert summary["transport"] == "shm+tcp"
    assert shm["pools_accepted"] == 1
    assert 3 <= shm["batches"] <= received - 3  # both kinds, in one trainer
    assert summary["batches"]["dropped"] == 0
    assert "pool p" in procs.log_text(local) and "offered to the trainer" in procs.log_text(local)
    assert "offered to the trainer" not in procs.log_text(remote)
    assert not os.path.lexists(sock)


def _child(args: list[str], log_path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.shm_canary", *args], cwd=REPO, env=cli_env(),
            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip


def run_canary(tmp_path, early: bool, steps: int = 120) -> tuple[dict, int]:
    """A canary trainer and one poisoning producer; (trainer summary, slots poisoned)."""
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    summary_path = tmp_path / "canary.json"
    trainer_args = ["--bind", endpoint, "--steps", str(steps), "--queue-mb", "1"]
    trainer_args += ["--shm-socket", str(tmp_path / "sock" / "pools.sock")]
    trainer_args += ["--json", str(summary_path)]
    children = [
        _child(["trainer", *(["--early"] if early else []), *trainer_args], tmp_path / "t.log"),
        _child(["producer", endpoint], tmp_path / "p.log"),
    ]
    try:
        assert children[0].wait(WAIT_S) == 0, (tmp_path / "t.log").read_text()[-3000:]
        children[1].send_signal(signal.SIGTERM)
        assert children[1].wait(30) == 0
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(10)
    out = (tmp_path / "p.log").read_text()
    assert "producer failed" not in out, out[-3000:]
    return json.loads(summary_path.read_text()), int(re.search(r"poisoned (\d+)", out)[1])


@pytest.mark.parametrize("early", [False, True], ids=["release-by-finalizer", "early-release"])
def test_content_canary_through_tensorflow(tmp_path, early):
    """The producer poisons every slot the moment its release arrives; the model checks every
    trained batch's content against the seq TensorFlow queued with it."""
    summary, poisoned = run_canary(tmp_path, early)
    trained, slots = summary["batches"]["trained"], summary["shm"]["slots_per_pool"]
    corrupted = summary["loss_last"]  # the model's running count of wrong batches
    assert summary["steps"] == 120 and trained == 122
    assert summary["batches"]["dropped"] == 0 and summary["shm"]["batches"] >= trained
    assert slots == pool_slots(3, 2, 2, 1) < poisoned  # slots were reused, many times over
    assert trained - slots <= poisoned
    if early:  # the same check, with slots released while TF still aliases them
        assert corrupted >= trained // 2, corrupted
    else:
        assert corrupted == 0, f"{corrupted:.0f} of {trained} trained batches corrupted"
