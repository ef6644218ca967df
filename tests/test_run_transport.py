"""``stagefeed run --transport auto``, the default: shared memory when its preconditions hold
on this host, else ZeroMQ over loopback tcp, and the summary (text and JSON) says which and
why (``stagefeed/loopback.py``). Real runs, real processes."""

from __future__ import annotations

import json
import os

from stagefeed import loopback
from stagefeed.common.options import TrainerOptions
from stagefeed.common.schema import ArraySpec, Schema
from tests.conftest import TINY, cli_env, run_cli

RUN = ["run", *TINY, "--steps", "2", "--producers", "1"]


def test_run_with_default_flags_chooses_shared_memory_here_and_says_so(tmp_path):
    path = tmp_path / "summary.json"
    done = run_cli([*RUN, "--json", str(path)], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(path.read_text())
    choice = summary["transport_choice"]
    assert (choice["asked"], choice["chosen"]) == ("auto", "shm"), choice
    assert choice["reason"].startswith("same host; 1 pool(s) of "), choice
    assert summary["transport"] == "shm+ipc" and summary["shm"]["batches"] > 0
    assert f"\n  --transport auto chose shm: {choice['reason']}\n" in done.stdout, done.stdout


def test_a_socket_path_too_long_for_shared_memory_makes_auto_choose_tcp(tmp_path):
    """A TMPDIR this deep leaves no room for the run's socket files (107 bytes at most)."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    path = tmp_path / "summary.json"
    done = run_cli([*RUN, "--json", str(path)], timeout=180, env=cli_env(TMPDIR=str(deep)))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(path.read_text())
    choice = summary["transport_choice"]
    assert (choice["asked"], choice["chosen"]) == ("auto", "zmq"), choice
    assert "over the 107 a Unix socket takes (a shorter TMPDIR fixes it)" in choice["reason"]
    assert summary["transport"] == "tcp" and summary["shm"] is None
    assert summary["endpoint"].startswith("tcp://127.0.0.1:")
    assert f"\n  --transport auto chose zmq: {choice['reason']}\n" in done.stdout
    assert os.listdir(deep) == []  # no socket file, no pool directory


def test_pools_larger_than_the_free_memory_rule_shared_memory_out():
    """Sizing only: nothing is allocated. 4096 slots (the most a pool has) of 1 GiB batches."""
    huge = Schema((ArraySpec("x", "float32", (2**28,)),), 1)
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=huge, queue_mb=10**7, queue_batches=10**4
    )
    ruled_out, reason = loopback.shm_ruled_out(options, producers=2, bind=None)
    assert ruled_out, reason
    assert reason.startswith("2 pool(s) of 4096.0 GiB would need 8192.0 GiB, "), reason
    assert reason.endswith(" is free"), reason
    plan = loopback.plan("auto", None, options, 2)
    assert (plan.transport, plan.bind, plan.chosen) == ("zmq", "tcp://127.0.0.1:*", "zmq")


def test_an_explicit_transport_is_taken_as_given():
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=Schema((ArraySpec("x", "float32"),), 2)
    )
    shm = loopback.plan("shm", None, options, 1)
    assert (shm.transport, shm.bind) == ("shm", f"ipc://{loopback.ipc_path()}")
    assert shm.summary() == {"asked": "shm", "chosen": "shm", "reason": "--transport shm"}
    zmq = loopback.plan("zmq", "ipc:///run/me.sock", options, 1)
    assert (zmq.transport, zmq.bind, zmq.chosen) == ("zmq", "ipc:///run/me.sock", "zmq")
