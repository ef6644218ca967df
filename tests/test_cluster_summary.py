"""The received rate in a cluster worker's summary (issue 28), through the real CLI: two
``stagefeed train`` workers of a TF_CONFIG cluster on loopback, each fed the whole of its
shards by a producer that delivers every batch while the cluster's first step is still being
traced. The summary's rate is over the time the batches were received
(``LedgerSnapshot.receiving_s``, ``FinalFigures.received_mb_per_s``), not over the window after
the first step, in which nothing came: that said ``received 0 B/s`` after every batch had
been received and trained.

Worker 1's producer stops 2 batches short of its shard, so its data ends first and the cluster
stops there: the chief says that the 2 batches worker 0 still held are not trained (a cluster
trains in lockstep; docs/resume.md, "Several trainer workers").
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli_env, free_tcp_port
from tests.matrix import data
from tests.test_cluster_cli import cluster_config, distinct_ports

pytestmark = pytest.mark.slow

END_S = 240  # two TensorFlow workers and two producers on two shared cores
SCHEMA = "tests.matrix.data:SCHEMA"
SHORT = 2  # worker 1's shard, short by this many batches


def test_a_worker_whose_batches_all_came_before_its_first_step_says_their_rate(
    start_cli, tmp_path
):
    tf_ports = distinct_ports(2)
    feeds = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    workers = [
        start_cli(
            ["train", "--schema", SCHEMA, "--model", "tests.matrix.data:keras_counter",
             "--bind", feeds[i], "--steps", "0", "--warmup-steps", "0", "--enqueue-threads", "1",
             "--json", str(tmp_path / f"worker-{i}.json")],
            name=f"worker-{i}", env=cli_env(TF_CONFIG=cluster_config(i, tf_ports)),
        )  # fmt: skip
        for i in range(2)
    ]
    # One producer process a worker: with two, the first could deliver all of its batches and
    # end before the second connected, and a worker whose every connected producer has ended
    # has seen the end of its data (docs/guarantees.md): the second's batches came too late.
    per_worker = data.total_batches() // 2
    sent = [per_worker, per_worker - SHORT]
    for i in range(2):
        start_cli(
            ["produce", "--connect", feeds[i], "--workers", "1", "--shard-group", f"{i}/2",
             "--schema", SCHEMA, "--source", "tests.matrix.data:stream",
             "--max-batches", str(sent[i])],
            name=f"producer-{i}",
        )  # fmt: skip
    for i, worker in enumerate(workers):
        code = worker.wait(END_S)
        log = worker.output()
        assert code == 0, log[-4000:]
        summary = json.loads((tmp_path / f"worker-{i}.json").read_text())
        assert summary["batches"]["received"] == sent[i], summary["batches"]
        assert summary["batches"]["trained"] == sent[1], summary["batches"]
        untrained = f"the data of worker 1 ended first: {SHORT} batches the other workers held"
        assert (untrained in log) == (i == 0), log[-3000:]
        received_mb = sent[i] * data.SCHEMA.batch_bytes / 2**20
        # Over the time the batches came, never longer than the run itself
        assert summary["received_mb_per_s"] >= received_mb / summary["wall_s"], summary
        assert "received 0 B/s" not in log and "received -" not in log, log[-3000:]
