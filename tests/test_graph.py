"""The feeding graph: placement, pinned copy on GPUs, staging, accounting components."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from stagefeed.common.errors import ConfigError
from stagefeed.common.spec import BatchSpec
from stagefeed.consumer import graph as feed_graph

v1 = tf.compat.v1
SPEC = BatchSpec(batch_size=2)


def test_device_is_cpu_without_a_gpu():
    assert not tf.config.list_physical_devices("GPU")
    assert feed_graph.pick_device("auto") == "/cpu:0"
    with pytest.raises(ConfigError, match="gpu"):
        feed_graph.pick_device("gpu")


def test_gpu_session_forces_pinned_host_memory():
    config = feed_graph.session_config("/gpu:0")
    assert config.gpu_options.force_gpu_compatible
    assert not feed_graph.session_config("/cpu:0").gpu_options.force_gpu_compatible


def test_gpu_graph_places_staging_and_model_on_the_gpu_and_copies_to_pinned_memory():
    # Building (not running) a GPU graph needs no GPU: placement is checked on the ops.
    feed = feed_graph.build(BatchSpec(batch_size=2, image_dtype="uint8"), 4, 2, "/gpu:0")
    ops = {op.name: op for op in feed.graph.get_operations()}
    copies = [op for op in ops.values() if op.type == "DeepCopy"]
    assert len(copies) == 1 and copies[0].device.endswith("CPU:0")
    stage = [op for op in ops.values() if op.type in ("Stage", "Unstage")]
    assert stage and all(op.device.endswith("GPU:0") for op in stage)
    casts = [op for op in ops.values() if op.type == "Cast" and op.inputs[0].dtype == tf.uint8]
    assert casts and all(op.device.endswith("GPU:0") for op in casts)
    convs = [op for op in ops.values() if op.type == "Conv2D"]
    assert len(convs) == 5 and all(op.device.endswith("GPU:0") for op in convs)


def test_cpu_graph_has_no_extra_copy():
    feed = feed_graph.build(SPEC, 4, 2, "/cpu:0")
    assert not [op for op in feed.graph.get_operations() if op.type == "DeepCopy"]


def test_batches_flow_queue_to_staging_to_step_in_order():
    feed = feed_graph.build(SPEC, 4, 2, "/cpu:0")
    with v1.Session(graph=feed.graph) as sess:
        sess.run(v1.variables_initializer(feed.graph.get_collection("variables")))
        rng = np.random.default_rng(0)
        for seq in range(4):
            sess.run(
                feed.enqueue,
                {
                    feed.images_in: rng.random(SPEC.image_shape, dtype=np.float32),
                    feed.labels_in: np.array([1, 2], np.int32),
                    feed.producer_in: 0,
                    feed.seq_in: seq,
                },
            )
        sess.run(feed.put)
        sess.run(feed.put)
        assert sess.run([feed.queue_size, feed.staged_size]) == [2, 2]
        trained = [sess.run([feed.trained_seq, feed.step])[0] for _ in range(2)]
        assert trained == [0, 1]
        assert sess.run([feed.queue_size, feed.staged_size]) == [0, 2]
