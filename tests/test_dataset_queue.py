"""The TF 2 feed's queue: components from the schema, enqueue from threads, close semantics."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.schema import ArraySpec, Schema, SchemaMismatch, image_schema
from stagefeed.consumer.devices import training_device
from stagefeed.consumer.tf2.eager_queue import EagerQueueFeed

SCHEMA = Schema(
    (
        ArraySpec("features", "float32", (3,)),
        ArraySpec("ids", "int64", (2,), bounds=(0, 10)),
    ),
    4,
)


def batch(value: int) -> dict[str, np.ndarray]:
    return {
        "features": np.full((4, 3), value, np.float32),
        "ids": np.full((4, 2), value % 10, np.int64),
    }


def test_queue_components_are_the_schema_arrays_then_peer_and_seq_on_the_host():
    feed = EagerQueueFeed(image_schema(batch_size=2, image_size=8, dtype="uint8"), 3)
    queue = feed.queue
    assert queue.dtypes == [tf.uint8, tf.int32, tf.int32, tf.int64]
    assert [s.as_list() for s in queue.shapes] == [[2, 8, 8, 3], [2], [], []]
    assert queue.queue_ref.device.endswith("CPU:0")
    assert feed.device == "/cpu:0" == training_device("auto")


def aligned(array: np.ndarray) -> np.ndarray:
    """A 64-byte-aligned copy: the kind of buffer a session feed would alias, not copy."""
    raw = np.empty(array.nbytes + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    out = raw[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    assert out.ctypes.data % 64 == 0
    return out


def test_enqueue_keeps_order_and_identity_and_copies_even_aligned_caller_buffers():
    feed = EagerQueueFeed(SCHEMA, 4)
    arrays = {name: aligned(a) for name, a in batch(1).items()}
    assert feed.enqueue(arrays, peer=3, seq=41)
    arrays["features"][:] = 99  # the queue holds its own copy: the caller may reuse its buffer
    assert feed.enqueue(batch(2), peer=5, seq=42)
    assert (feed.size(), feed.enqueued) == (2, 2)
    features, ids, peer, seq = feed.queue.dequeue()
    assert (int(peer), int(seq)) == (3, 41)
    np.testing.assert_array_equal(features.numpy(), np.full((4, 3), 1, np.float32))
    np.testing.assert_array_equal(ids.numpy(), np.full((4, 2), 1, np.int64))


def test_a_batch_unlike_the_schema_is_refused_naming_the_array():
    feed = EagerQueueFeed(SCHEMA, 2)
    wrong = batch(1) | {"ids": np.zeros((4, 2), np.int32)}
    with pytest.raises(SchemaMismatch, match=r"ids is int32\[4, 2\], expected int64\[4, 2\]"):
        feed.enqueue(wrong, 0, 0)
    with pytest.raises(SchemaMismatch, match="expected"):
        feed.enqueue({"features": batch(1)["features"]}, 0, 0)
    assert feed.enqueued == 0 and feed.size() == 0


def test_close_unblocks_a_full_queue_and_later_enqueues_return_false():
    feed = EagerQueueFeed(SCHEMA, 1)
    assert feed.enqueue(batch(0), 0, 0)
    results: list[bool] = []
    blocked = threading.Thread(
        target=lambda: results.append(feed.enqueue(batch(1), 0, 1)), name="test-enqueue"
    )
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # waiting for room
    feed.close()
    feed.close()
    blocked.join(5)
    assert not blocked.is_alive() and results == [False]
    assert not feed.enqueue(batch(2), 0, 2)
    assert (feed.enqueued, feed.size(), feed.closed) == (1, 1, True)  # queued batches stay


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="capacity"):
        EagerQueueFeed(SCHEMA, 0)
    with pytest.raises(ConfigError, match="Schema"):
        EagerQueueFeed({"batch_size": 4}, 2)

    @tf.function(autograph=False)
    def inside():
        EagerQueueFeed(SCHEMA, 2)
        return tf.constant(0)

    with pytest.raises(ConfigError, match="eagerly"):
        inside()
