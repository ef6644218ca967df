"""consumer/cluster without a cluster: TF_CONFIG facts, the verdict's decoding and wording, the
one-line cause of a broken cluster, what is refused at start."""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.tf_config import NO_CLUSTER, ClusterPlace
from stagefeed.common.tf_config import place as tf_place
from stagefeed.consumer.cluster import strategy
from stagefeed.consumer.cluster.collective_stop import decode, vote_for
from stagefeed.consumer.cluster.loop import broken_cause
from stagefeed.consumer.run_end import Ending, Verdict


def tf_config(kind: str = "worker", index: int = 0, workers: int = 2, chief: int = 0) -> dict:
    cluster = {"worker": [f"127.0.0.1:{2000 + i}" for i in range(workers)]}
    if chief:
        cluster["chief"] = ["127.0.0.1:1999"]
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})}


def _at(place: ClusterPlace) -> tuple[int, int, bool]:
    return place.index, place.count, place.chief


def test_the_place_counts_the_chief_first():
    assert _at(tf_place({})) == (0, 1, True)
    assert _at(tf_place(tf_config("worker", 1))) == (1, 2, False)
    assert _at(tf_place(tf_config("chief", 0, chief=1))) == (0, 3, True)
    assert _at(tf_place(tf_config("worker", 1, chief=1))) == (2, 3, False)
    assert tf_place(tf_config()).in_cluster and not tf_place(tf_config(workers=1)).in_cluster
    assert tf_place(tf_config(workers=1)).named and not tf_place({}).named
    assert not tf_place({}).in_cluster


@pytest.mark.parametrize(
    ("environ", "complaint"),
    [
        ({"TF_CONFIG": "{not json"}, "TF_CONFIG is not JSON"),
        (tf_config("worker", 5), "task.index 5 is out of range: cluster.worker has 2 tasks"),
        (tf_config("ps", 0), "task.type 'ps' is not in the cluster"),
    ],
)
def test_a_bad_tf_config_is_one_config_error(environ, complaint):
    with pytest.raises(ConfigError, match=complaint):
        tf_place(environ)


def test_graph_mode_is_refused_in_a_cluster_with_one_line():
    strategy.refuse_in_cluster("graph mode", tf_place({}))
    with pytest.raises(ConfigError) as raised:
        strategy.refuse_in_cluster("graph mode", tf_place(tf_config(workers=3)))
    assert str(raised.value) == (
        "graph mode trains on one worker, and TF_CONFIG names a cluster of 3: several "
        "trainers need a Keras --model build(schema), or unset TF_CONFIG"
    )


def test_make_cluster_refuses_bad_settings_before_tensorflow_starts():
    with pytest.raises(ConfigError, match="need TF_CONFIG"):
        strategy.make_cluster(NO_CLUSTER)
    with pytest.raises(ConfigError, match="one of"):
        strategy.make_cluster(NO_CLUSTER, implementation="gloo")
    with pytest.raises(ConfigError, match="> 0 seconds"):
        strategy.make_cluster(NO_CLUSTER, timeout_s=0)


def test_the_verdict_is_the_highest_vote_and_names_who_and_why():
    # two workers of two replicas each: (vote, batch size) per replica
    running = decode([0, 4, 0, 4, 0, 4, 0, 4], local_replicas=2)
    assert running.go and running.global_batch == 16 and running.reason == "running"
    stop = decode([0, 4, 2, 4, 0, 4, 0, 4], local_replicas=2)
    assert stop.ending is Ending.STOP and stop.votes == (Ending.STOP, Ending.RUNNING)
    assert stop.reason == "worker 0 stops"
    ended = decode([0, 4, 0, 4, 1, 0, 1, 0], local_replicas=2)
    assert ended.ending is Ending.DRAIN and ended.no_data == (1,)
    assert ended.reason == "the data of worker 1 ended"
    failed = decode([3, 4, 2, 4], local_replicas=1)
    assert failed.reason == "worker 0 failed" and failed.workers == (0,)
    # every worker's data ended (no batch anywhere): the ballot of sizes 0 still carries a stop
    all_ended = decode([1, 0, 1, 0], local_replicas=1)
    assert all_ended.reason == "every worker's data ended" and not all_ended.go
    stopped = decode([1, 0, 2, 0], local_replicas=1)
    assert stopped.ending is Ending.STOP and stopped.reason == "worker 1 stops"


def test_a_draining_worker_votes_to_train_its_tail():
    assert vote_for(Verdict(Ending.DRAIN, "data ended")) is Ending.RUNNING
    assert vote_for(Verdict(Ending.STOP, "stop requested")) is Ending.STOP
    assert vote_for(Verdict(Ending.FAIL, "x", failure=RuntimeError())) is Ending.FAIL


def test_a_broken_clusters_cause_is_one_short_line():
    # The text TensorFlow 2.21 raised in the SIGKILL and timeout runs (docs/scaling.md)
    heartbeat = tf.errors.UnavailableError(None, None, (
        "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent "
        "call last):\n  File \"<frozen runpy>\", line 198, in _run_module_as_main\n\n"
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following "
        "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\n"
        "The tasks have crashed. Check the task logs for an earlier error.\nThe error could be "
        "from a previous operation. Restart your program to reset.\n\t [[{{node "
        "CollectiveReduceV2}}]] [Op:__inference__next_fn_273]"
    ))  # fmt: skip
    assert broken_cause(heartbeat) == (
        "UnavailableError: Error reported from /job:worker/task:1: The following tasks are "
        "unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:1"
    )
    timeout = tf.errors.DeadlineExceededError(None, None, (
        "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent "
        "call last):\n  File \"x.py\", line 1, in f\n\nCollective has timed out during "
        "execution.\n\t [[{{node CollectiveReduceV2}}]]"
    ))  # fmt: skip
    expected = "DeadlineExceededError: Collective has timed out during execution."
    assert broken_cause(timeout) == expected
