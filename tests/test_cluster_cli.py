"""``stagefeed train`` as two workers of a MultiWorkerMirroredStrategy cluster (real processes
on loopback, ``TF_CONFIG`` on 127.0.0.1 ports): each worker binds its own feed, producers feed
them, and both train the same steps with the compiled Keras model (consumer/cluster/trainer.py).
"""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from tests.conftest import cli_env, free_tcp_port, run_cli, wait_for

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 240  # two TensorFlow trainers and their producers on two shared cores
KERAS = [
    "--schema", "tests.helpers.regression_models:SCHEMA", "--model",
        "tests.helpers.regression_models:build",
    "--enqueue-threads", "1", "--warmup-steps", "0",
]  # fmt: skip


def cluster_config(index: int, ports: list[int]) -> str:
    workers = [f"127.0.0.1:{port}" for port in ports]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def distinct_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_tcp_port())
    return sorted(ports)


class Cluster:
    """Two ``stagefeed train`` workers of one TF_CONFIG cluster and two producers, each
    producer connected to both workers' feeds (``--connect`` repeated)."""

    def __init__(self, start_cli, tmp_path, steps: int) -> None:
        self.tmp_path = tmp_path
        tf_ports, feed_ports = distinct_ports(2), distinct_ports(2)
        feeds = [f"tcp://127.0.0.1:{port}" for port in feed_ports]
        self.trainers = []
        for index in range(2):
            env = cli_env(TF_CONFIG=cluster_config(index, tf_ports))
            self.trainers.append(start_cli(
                ["train", *KERAS, "--bind", feeds[index], "--steps", str(steps),
                 "--json", str(tmp_path / f"worker-{index}.json"),
                 "--save", str(tmp_path / f"save-{index}")],
                name=f"worker-{index}", env=env,
            ))  # fmt: skip
        self.producers = [
            start_cli(
                ["produce", "--connect", feeds[0], "--connect", feeds[1], "--rate", "20",
                 "--schema", "tests.helpers.regression_models:SCHEMA", "--seed", str(k)],
                name=f"producer-{k}",
            )  # fmt: skip
            for k in range(2)
        ]

    def summary(self, index: int) -> dict:
        return json.loads((self.tmp_path / f"worker-{index}.json").read_text())


def test_two_workers_two_producers_each_feeding_both_train_the_same_steps(start_cli, tmp_path):
    steps = 12
    cluster = Cluster(start_cli, tmp_path, steps)
    for index, trainer in enumerate(cluster.trainers):
        assert trainer.wait(RUN_TIMEOUT_S) == 0, trainer.output()[-4000:]
        assert f"worker {index}/2" in trainer.output()
    summaries = [cluster.summary(i) for i in range(2)]
    for summary in summaries:
        assert summary["steps"] == steps and summary["loss_finite"], summary
        assert summary["batches"]["trained"] == steps  # one replica a worker: a batch a step
        assert summary["batches"]["dropped"] == 0 and summary["batches"]["seq_missing"] == 0
        rows = summary["producers"].values()
        assert len(rows) == 2  # both producers fed this worker
        for row in rows:  # every batch a worker received is trained or still queued: no loss
            assert row["received"] == row["trained"] + row["queued_at_stop"] + row[
                "abandoned"] + row["not_enqueued"] and row["dropped"] == {}, row
        assert set(summary["metrics"]) == {"mae"}
    # The step's loss is all-reduced: every worker reports the same figures.
    assert summaries[0]["loss_last"] == summaries[1]["loss_last"]
    # The cluster's books, the same on every worker: the workers' totals summed.
    books = summaries[0]["cluster"]["books"]
    assert books == summaries[1]["cluster"]["books"]
    assert (books["workers"], books["steps"], books["trained"]) == (2, steps, 2 * steps)
    # (taken when the loop ended: batches may still arrive until the feeds close)
    assert 2 * steps <= books["received"] <= sum(s["batches"]["received"] for s in summaries)
    assert [s["cluster"]["chief"] for s in summaries] == [True, False]
    assert "cluster: worker 0/2 (chief); all workers: 12 steps" in cluster.trainers[0].output()
    assert (tmp_path / "save-0" / "model.keras").exists()  # the chief keeps the model
    assert not (tmp_path / "save-1" / "model.keras").exists()  # another worker does not
    for producer in cluster.producers:
        producer.signal()


def test_a_producer_killed_is_survived_and_a_worker_killed_stops_the_other(start_cli, tmp_path):
    """A producer killed mid-run: the other feeds both workers on. Then a worker killed
    mid-run: the survivor leaves its collective with one line naming the broken cluster
    (exit 3) within two of the coordination service's heartbeat timeouts (10 s), not a hang."""
    cluster = Cluster(start_cli, tmp_path, steps=0)  # until stopped
    progress = re.compile(r"step (\d+)/-")

    def steps_of(index: int) -> int:
        found = progress.findall(cluster.trainers[index].output())
        return int(found[-1]) if found else 0

    assert wait_for(lambda: steps_of(0) >= 3, 180), cluster.trainers[0].output()[-3000:]
    cluster.producers[0].kill_group()
    reached = steps_of(0)
    assert wait_for(lambda: steps_of(0) >= reached + 5, 120), cluster.trainers[0].output()[-3000:]
    cluster.trainers[1].kill_group()
    killed = time.monotonic()
    code = cluster.trainers[0].wait(120)
    took = time.monotonic() - killed
    output = cluster.trainers[0].output()
    assert code == 3, output[-3000:]
    assert "cluster broken after step" in output and "restart every worker" in output
    assert "stagefeed summary" in output and "Traceback" not in output, output[-6000:]
    assert took < 60, took  # the heartbeat timeout (10 s) with room for a loaded machine
    cluster.producers[1].signal()


def test_graph_mode_in_a_cluster_is_refused_in_one_line():
    env = cli_env(TF_CONFIG=cluster_config(0, distinct_ports(2)))
    done = run_cli(
        ["train", "--schema", "tests.helpers.regression_models:SCHEMA",
         "--model", "tests.helpers.regression_models:linear_fn", "--steps", "2"],
        env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    said = "stagefeed: error: graph mode (--model 'tests.helpers.regression_models:"
    assert line.startswith(said)
    assert "TF_CONFIG names a cluster of 2" in line and "Traceback" not in done.stderr


def test_a_worker_whose_cluster_address_is_taken_is_refused_in_one_line():
    ports = distinct_ports(2)
    with socket.socket() as taken:  # what another process holds: this worker's gRPC port
        taken.bind(("127.0.0.1", ports[1]))
        taken.listen()
        done = run_cli(["train", *KERAS, "--steps", "2", "--bind", f"tcp://127.0.0.1:{free_tcp_port()}"],
                       env=cli_env(TF_CONFIG=cluster_config(1, ports)))  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line == ("stagefeed: error: TF_CONFIG: worker 1 cannot start its gRPC server at the "
                    "address the cluster gives its task (the port is in use, or the host is not "
                    "this machine)"), done.stderr[-3000:]  # fmt: skip
    assert "Traceback" not in done.stderr
