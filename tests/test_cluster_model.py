"""A model whose output does not fit the targets, in a TF_CONFIG cluster (issue 28), through
the real CLI: two ``stagefeed train`` workers on loopback. The start check of the single
trainer (``check_step``: one step traced on the schema's batch) refuses the model on every
worker in one line naming it, exit 2, no traceback; a step that fails all the same (labels
without bounds, out of range at the first step) ends every worker with its summary, then one
line naming the model and what TensorFlow said, exit 3 (consumer/cluster/trainer.py,
consumer/keras_fit/model_check.py, consumer/model_ref.step_failed)."""

from __future__ import annotations

import pytest

from tests.conftest import cli_env, free_tcp_port
from tests.test_cluster_cli import cluster_config, distinct_ports

pytestmark = pytest.mark.slow

END_S = 240  # two TensorFlow workers on two shared cores


def _workers(start_cli, schema: str, model: str) -> tuple[list, list[str]]:
    """Two workers of one cluster (``--steps 5``), each on its own feed; the feeds."""
    tf_ports = distinct_ports(2)
    feeds = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    workers = [
        start_cli(
            ["train", "--schema", schema, "--model", model, "--bind", feeds[i], "--steps", "5",
             "--enqueue-threads", "1"],
            name=f"worker-{i}", env=cli_env(TF_CONFIG=cluster_config(i, tf_ports)),
        )  # fmt: skip
        for i in range(2)
    ]
    return workers, feeds


def _last_line(log: str) -> str:
    return log.strip().splitlines()[-1]


def test_a_model_whose_output_does_not_fit_is_refused_at_start_by_every_worker(start_cli):
    model = "tests.matrix.data:keras_wrong_output"
    workers, _ = _workers(start_cli, "tests.matrix.data:SCHEMA", model)
    for worker in workers:
        code = worker.wait(END_S)
        log = worker.output()
        assert code == 2, log[-4000:]
        assert "Traceback" not in log, log[-4000:]
        last = _last_line(log)
        refused = f"stagefeed: error: --model '{model}': one training step on the schema's batch"
        assert last.startswith(f"{refused} fails: ValueError: Dimensions must be"), last
        assert "[4], [4,10]" in last, last
        assert "stagefeed summary" not in log  # refused at start: no run


def test_a_step_that_fails_ends_every_worker_with_its_summary_then_one_line(start_cli):
    """Labels without bounds: nothing to check at start; TensorFlow refuses label 9 for 3
    classes at the first step, on both workers."""
    model = "tests.helpers.model_fit:three_classes"
    workers, feeds = _workers(start_cli, "tests.helpers.model_fit:UNBOUNDED", model)
    producer = start_cli(
        ["produce", "--connect", feeds[0], "--connect", feeds[1], "--schema",
         "tests.helpers.model_fit:UNBOUNDED", "--source", "examples.keras_images:batches"],
        name="producer",
    )  # fmt: skip
    for worker in workers:
        code = worker.wait(END_S)
        log = worker.output()
        assert code == 3, log[-4000:]
        assert "Traceback" not in log, log[-4000:]
        assert "stagefeed summary" in log, log[-4000:]
        last = _last_line(log)
        assert f"ERROR MainProcess stagefeed: --model '{model}': a train step failed: " \
            "InvalidArgumentError: " in last, last  # fmt: skip
        assert "outside the valid range of [0, 3)" in last, last
    producer.signal()
