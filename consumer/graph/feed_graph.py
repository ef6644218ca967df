"""Graph mode: FIFOQueue on the CPU -> StagingArea on the device -> the user's ``model_fn``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from stagefeed.common.options import MIB
from stagefeed.common.schema import Schema
from stagefeed.consumer.cast import cast_arrays
from stagefeed.consumer.devices import is_gpu
from stagefeed.consumer.queue_element import PEER_DTYPE, SEQ_DTYPE, queue_element

try:  # not public in TF 2 (tensorflow/community#178); present from 1.x to 2.21 at least
    from tensorflow.python.ops.data_flow_ops import StagingArea
except ImportError as exc:  # pragma: no cover - depends on the installed TensorFlow
    raise ImportError(
        f"graph mode needs TensorFlow's StagingArea, missing in TF {tf.__version__}; "
        "use the tf.data path (stagefeed.Feed.dataset)"
    ) from exc

log = logging.getLogger(__name__)
v1 = tf.compat.v1
# Graph collections holding the staged batch's connection index (int32) and sequence number
# (int64): ``v1.get_collection(STAGED_SEQ)[0]`` inside a model_fn (the shm canary test).
STAGED_PEER = "stagefeed_staged_peer"
STAGED_SEQ = "stagefeed_staged_seq"


def session_config(device: str) -> v1.ConfigProto:
    """Pinned host memory for CPU tensors on GPU builds, so host-to-device copies are async DMA.

    ``force_gpu_compatible`` makes every CPU allocation of the session pinned (CUDA host
    memory); TensorFlow otherwise pins only tensors it infers feed a copy, and a tensor fed from
    numpy into a FIFOQueue never is (background.md). It has no effect without a GPU.
    """
    config = v1.ConfigProto(allow_soft_placement=False)
    if is_gpu(device):
        config.gpu_options.force_gpu_compatible = True
        config.gpu_options.allow_growth = True
    return config


@dataclasses.dataclass
class FeedGraph:
    """Placeholders and ops of the feeding path and train step, in their own ``tf.Graph``.

    Queue components: the schema's arrays in wire order, then the connection index (int32)
    and the sequence number (int64), so every trained batch traces back to its message.
    """

    graph: tf.Graph
    device: str
    schema: Schema
    inputs: dict[str, tf.Tensor]  # one placeholder per array
    peer_in: tf.Tensor
    seq_in: tf.Tensor
    enqueue: tf.Operation
    close_queue: tf.Operation
    queue_size: tf.Tensor
    put: tf.Operation
    staged_size: tf.Tensor
    step: tf.Operation  # train op grouped with the next put
    train_only: tf.Operation  # the train op alone: drains the staging area at end of data
    loss: tf.Tensor
    trained_peer: tf.Tensor
    trained_seq: tf.Tensor
    capacity: int

    def enqueuer(self, session: Any) -> Callable[[dict[str, Any], int, int], bool]:
        """``enqueue(arrays, peer, seq)`` for the intake's threads: False once the queue closed."""

        def enqueue(arrays: dict[str, Any], peer: int, seq: int) -> bool:
            feed = {self.inputs[name]: arrays[name] for name in self.schema.names}
            feed[self.peer_in] = peer
            feed[self.seq_in] = seq
            try:
                session.run(self.enqueue, feed)
            except (tf.errors.CancelledError, tf.errors.OutOfRangeError):
                return False  # closed for shutdown: the batch stays "not enqueued"
            return True

        return enqueue


# (staged arrays by name, cast and scaled as the schema says; schema) -> (loss, train op).
ModelFn = Callable[[dict[str, tf.Tensor], Schema], tuple[tf.Tensor, tf.Operation]]


def build(
    schema: Schema,
    queue_capacity: int,
    stage_depth: int,
    device: str,
    model_fn: ModelFn,
) -> FeedGraph:
    """Build the feeding path and a step. ``device`` is ``/cpu:0`` or ``/gpu:0``.

    ``model_fn`` builds the step on the staged tensors (``bench ingest`` uses a trivial one).
    """
    graph = tf.Graph()
    dtypes, shapes = queue_element(schema)
    with graph.as_default():
        with tf.device("/cpu:0"):
            inputs = {
                name: v1.placeholder(dtype, shape, name=name)
                for name, dtype, shape in zip(schema.names, dtypes, shapes, strict=False)
            }
            peer_in = v1.placeholder(PEER_DTYPE, [], name="peer")
            seq_in = v1.placeholder(SEQ_DTYPE, [], name="seq")
            queued = [inputs[name] for name in schema.names]
            if is_gpu(device):
                # A received frame is fed as pageable memory; one copy on the enqueue thread
                # moves it into pinned memory (force_gpu_compatible), off the training path.
                queued = [tf.raw_ops.DeepCopy(x=t) for t in queued]
            queue = tf.queue.FIFOQueue(queue_capacity, dtypes, shapes=shapes, name="batches")
            enqueue = queue.enqueue([*queued, peer_in, seq_in])
            close_queue = queue.close(cancel_pending_enqueues=True)
            queue_size = queue.size()
            dequeued = queue.dequeue()
        with tf.device(device):
            staging = StagingArea(dtypes, shapes=shapes, capacity=stage_depth)
            put = staging.put(dequeued)
            staged_size = staging.size()
            *arrays, peer, seq = staging.get()
            # Where each staged batch came from, for a model_fn that checks its input.
            v1.add_to_collection(STAGED_PEER, peer)
            v1.add_to_collection(STAGED_SEQ, seq)
            staged = cast_arrays(schema, dict(zip(schema.names, arrays, strict=True)))
            loss, train = model_fn(staged, schema)
            step = tf.group(train, put, name="step")
    log.info(
        "graph on %s: FIFOQueue of %d batches (%.0f MiB), staging depth %d; %s",
        device,
        queue_capacity,
        queue_capacity * schema.batch_bytes / MIB,
        stage_depth,
        schema.describe(),
    )
    return FeedGraph(
        graph=graph,
        device=device,
        schema=schema,
        inputs=inputs,
        peer_in=peer_in,
        seq_in=seq_in,
        enqueue=enqueue,
        close_queue=close_queue,
        queue_size=queue_size,
        put=put,
        staged_size=staged_size,
        step=step,
        train_only=train,
        loss=loss,
        trained_peer=peer,
        trained_seq=seq,
        capacity=queue_capacity,
    )
