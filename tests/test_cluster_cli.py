"""``stagefeed train`` as two workers of a MultiWorkerMirroredStrategy cluster (real processes
on loopback, ``TF_CONFIG`` on 127.0.0.1 ports): each worker binds its own feed, producers feed
them, and both train the same steps with the compiled Keras model (consumer/cluster/trainer.py).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, free_tcp_port, run_cli

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 240  # two TensorFlow trainers and their producers on two shared cores
KERAS = [
    "--schema", "tests.regression_models:SCHEMA", "--model", "tests.regression_models:build",
    "--recv-threads", "1", "--warmup-steps", "0",
]  # fmt: skip


def cluster_config(index: int, ports: list[int]) -> str:
    workers = [f"127.0.0.1:{port}" for port in ports]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def distinct_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_tcp_port())
    return sorted(ports)


def test_two_workers_train_the_same_steps_each_from_its_own_feed(start_cli, tmp_path):
    steps = 12
    tf_ports, feed_ports = distinct_ports(2), distinct_ports(2)
    trainers, producers = [], []
    for index in range(2):
        env = cli_env(TF_CONFIG=cluster_config(index, tf_ports))
        trainers.append(start_cli(
            ["train", *KERAS, "--bind", f"tcp://127.0.0.1:{feed_ports[index]}",
             "--steps", str(steps), "--json", str(tmp_path / f"worker-{index}.json"),
             "--save", str(tmp_path / f"save-{index}")],
            name=f"worker-{index}", env=env,
        ))  # fmt: skip
        producers.append(start_cli(
            ["produce", "--connect", f"tcp://127.0.0.1:{feed_ports[index]}",
             "--schema", "tests.regression_models:SCHEMA", "--seed", str(index)],
            name=f"producer-{index}",
        ))  # fmt: skip
    for index, trainer in enumerate(trainers):
        code = trainer.wait(RUN_TIMEOUT_S)
        assert code == 0, trainer.output()[-4000:]
        assert f"worker {index}/2" in trainer.output()
    summaries = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    for summary in summaries:
        assert summary["steps"] == steps and summary["loss_finite"], summary
        assert summary["batches"]["trained"] == steps  # one replica a worker: a batch a step
        (row,) = summary["producers"].values()  # this worker's own producer, nobody else's
        assert row["trained"] == steps and row["dropped"] == {}
        assert set(summary["metrics"]) == {"mae"}
    # The step's loss is all-reduced: every worker reports the same figures.
    assert summaries[0]["loss_last"] == summaries[1]["loss_last"]
    assert (tmp_path / "save-0" / "model.keras").exists()  # the chief keeps the model
    assert not (tmp_path / "save-1" / "model.keras").exists()  # another worker does not
    for producer in producers:
        producer.signal()


def test_graph_mode_in_a_cluster_is_refused_in_one_line():
    env = cli_env(TF_CONFIG=cluster_config(0, distinct_ports(2)))
    done = run_cli(
        ["train", "--schema", "tests.regression_models:SCHEMA",
         "--model", "tests.regression_models:linear_fn", "--steps", "2"],
        env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("stagefeed: error: graph mode (--model 'tests.regression_models:")
    assert "TF_CONFIG names a cluster of 2" in line and "Traceback" not in done.stderr
