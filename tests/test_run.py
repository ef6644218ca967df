"""``stagefeed run`` end to end: real trainer and producer processes, JSON summary checked."""

from __future__ import annotations

import json
import math
import os

import psutil
import pytest

from tests.conftest import TINY, run_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("dtype", "transport"), [("float32", "tcp"), ("uint8", "ipc")], ids=["float32-tcp", "uint8-ipc"]
)
def test_run_trains_and_writes_the_summary(tmp_path, dtype, transport):
    """ZeroMQ batches over loopback tcp, or over an ipc socket named by --bind."""
    summary_path = tmp_path / f"summary-{dtype}.json"
    bind = [] if transport == "tcp" else ["--bind", f"ipc://{tmp_path}/run.sock"]
    done = run_cli(
        [
            "run",
            *TINY,
            "--steps",
            "4",
            "--producers",
            "2",
            "--dtype",
            dtype,
            "--transport",
            "zmq",
            *bind,
            "--json",
            str(summary_path),
        ],
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "stagefeed summary" in done.stdout and "ms/step median" in done.stdout
    assert "step " in done.stderr  # progress was shown while it ran
    summary = json.loads(summary_path.read_text())
    assert summary["wire_dtype"] == dtype and summary["batch_size"] == 2
    assert summary["transport"] == transport and summary["endpoint"].startswith(transport)
    assert summary["transport_choice"] == {
        "asked": "zmq", "chosen": "zmq", "reason": "--transport zmq"
    }  # fmt: skip
    assert summary["steps"] == 4 and summary["warmup_steps"] == 2
    assert not summary["interrupted"]
    for key in ("median_ms", "p90_ms", "examples_per_s", "received_mb_per_s"):
        assert summary[key] > 0, key
    assert summary["p90_ms"] >= summary["median_ms"]
    assert 0 <= summary["stall_pct"] <= 100
    # The seed's AlexNet (dense kernels of stddev 1.0, SGD 0.01) diverges on batches of 2
    # random images after a few steps: only the first loss is asked to be finite here.
    assert summary["loss_first"] is not None and math.isfinite(summary["loss_first"])
    assert summary["advice"]
    batches = summary["batches"]
    assert batches["trained"] == 6 and batches["dropped"] == 0
    assert batches["received"] == (
        batches["trained"] + batches["queued_at_stop"] + batches["not_enqueued"]
    )
    producers = summary["producers"]
    assert len(producers) == 2
    assert sum(p["received"] for p in producers.values()) == batches["received"]
    assert all(
        p["trained_duplicates"] == 0 and p["seq_duplicates"] == 0 for p in producers.values()
    )
    # Nothing left behind: no producer process, no ipc socket file.
    pids = [int(producer.rsplit("-", 3)[1]) for producer in producers]  # host-pid-index-nonce
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    if transport == "ipc":
        assert not os.path.exists(summary["endpoint"].removeprefix("ipc://"))


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [("--enqueue-threads", "0", "enqueue_threads"), ("--wait-log-s", "-1", "wait_log_s")],
)
def test_bad_flag_fails_at_start_naming_the_value(flag, value, named):
    done = run_cli(["run", "--batch-size", "2", flag, value], timeout=60)
    assert done.returncode == 2
    assert named in done.stderr and value in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_environment_value_fails_at_start_naming_it():
    from tests.conftest import cli_env

    done = run_cli(["run"], timeout=60, env=cli_env(STAGEFEED_QUEUE_MB="lots"))
    assert done.returncode == 2
    assert "STAGEFEED_QUEUE_MB='lots'" in done.stderr
