"""The feeding graph: placement, pinned copy on GPUs, staging, accounting components."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from stagefeed.common.schema import image_schema
from stagefeed.consumer.graph import feed_graph
from stagefeed.consumer.graph.alexnet import model_fn

v1 = tf.compat.v1
SPEC = image_schema(batch_size=2)


def test_gpu_session_forces_pinned_host_memory():
    config = feed_graph.session_config("/gpu:0")
    assert config.gpu_options.force_gpu_compatible
    assert not feed_graph.session_config("/cpu:0").gpu_options.force_gpu_compatible


def test_gpu_graph_places_staging_and_model_on_the_gpu_and_copies_to_pinned_memory():
    # Building (not running) a GPU graph needs no GPU: placement is checked on the ops.
    feed = feed_graph.build(image_schema(batch_size=2, dtype="uint8"), 4, 2, "/gpu:0", model_fn)
    ops = {op.name: op for op in feed.graph.get_operations()}
    copies = [op for op in ops.values() if op.type == "DeepCopy"]
    # One pinned copy per array, on the enqueue thread's side of the queue.
    assert len(copies) == 2 and all(op.device.endswith("CPU:0") for op in copies)
    stage = [op for op in ops.values() if op.type in ("Stage", "Unstage")]
    assert stage and all(op.device.endswith("GPU:0") for op in stage)
    casts = [op for op in ops.values() if op.type == "Cast" and op.inputs[0].dtype == tf.uint8]
    assert casts and all(op.device.endswith("GPU:0") for op in casts)
    convs = [op for op in ops.values() if op.type == "Conv2D"]
    assert len(convs) == 5 and all(op.device.endswith("GPU:0") for op in convs)


def test_cpu_graph_has_no_extra_copy():
    feed = feed_graph.build(SPEC, 4, 2, "/cpu:0", model_fn)
    assert not [op for op in feed.graph.get_operations() if op.type == "DeepCopy"]


def test_batches_flow_queue_to_staging_to_step_in_order():
    feed = feed_graph.build(SPEC, 4, 2, "/cpu:0", model_fn)
    with v1.Session(graph=feed.graph) as sess:
        sess.run(v1.variables_initializer(feed.graph.get_collection("variables")))
        rng = np.random.default_rng(0)
        for seq in range(4):
            images = rng.random(SPEC.batch_shape(SPEC["images"]), dtype=np.float32)
            arrays = {"images": images, "labels": np.array([1, 2], np.int32)}
            assert feed.enqueuer(sess)(arrays, 0, seq)
        sess.run(feed.put)
        sess.run(feed.put)
        assert sess.run([feed.queue_size, feed.staged_size]) == [2, 2]
        trained = [sess.run([feed.trained_seq, feed.step])[0] for _ in range(2)]
        assert trained == [0, 1]
        assert sess.run([feed.queue_size, feed.staged_size]) == [0, 2]


def test_custom_model_fn_gets_the_staged_arrays_by_name_cast_as_declared():
    from stagefeed.common.schema import ArraySpec, Schema

    schema = Schema(
        (ArraySpec("x", "uint8", (3,), cast="float32", scale=0.5), ArraySpec("y", "int64")), 2
    )
    seen = {}

    def linear(staged, schema_):
        seen.update({k: v.dtype for k, v in staged.items()})
        w = v1.get_variable("w", [3], initializer=v1.ones_initializer())
        loss = tf.reduce_sum(staged["x"] * w) + tf.cast(tf.reduce_sum(staged["y"]), tf.float32)
        return loss, v1.train.GradientDescentOptimizer(0.0).minimize(loss)

    feed = feed_graph.build(schema, 2, 1, "/cpu:0", linear)
    assert seen == {"x": tf.float32, "y": tf.int64}
    with v1.Session(graph=feed.graph) as sess:
        sess.run(v1.global_variables_initializer())
        enqueue = feed.enqueuer(sess)
        for seq in range(2):
            assert enqueue({"x": np.full((2, 3), 2, np.uint8), "y": np.ones(2, np.int64)}, 0, seq)
        sess.run(feed.put)
        loss, seq, _ = sess.run([feed.loss, feed.trained_seq, feed.step])
        assert (loss, seq) == (2 * 3 * 1.0 + 2, 0)  # x * 0.5 = 1.0, six of them, plus y
        sess.run(feed.close_queue)
        assert not enqueue({"x": np.zeros((2, 3), np.uint8), "y": np.ones(2, np.int64)}, 0, 9)
