"""The TensorFlow graph: FIFOQueue on the CPU -> StagingArea on the device -> AlexNet step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import tensorflow as tf
from stagefeed.common.errors import ConfigError
from stagefeed.common.spec import BatchSpec
from stagefeed.consumer import model
from tensorflow.python.ops.data_flow_ops import StagingArea

log = logging.getLogger(__name__)
v1 = tf.compat.v1


def pick_device(requested: str = "auto") -> str:
    """``/gpu:0`` when TensorFlow sees a GPU (or ``gpu`` was asked and exists), else ``/cpu:0``."""
    gpus = tf.config.list_physical_devices("GPU")
    if requested == "gpu" and not gpus:
        raise ConfigError("device 'gpu' requested but TensorFlow sees no GPU")
    if requested == "cpu" or not gpus:
        return "/cpu:0"
    return "/gpu:0"


def session_config(device: str) -> v1.ConfigProto:
    """Pinned host memory for CPU tensors on GPU builds, so host-to-device copies are async DMA.

    ``force_gpu_compatible`` makes every CPU allocation of the session pinned (CUDA host
    memory); TensorFlow otherwise pins only tensors it infers feed a copy, and a tensor fed from
    numpy into a FIFOQueue never is (background.md). It has no effect without a GPU.
    """
    config = v1.ConfigProto(allow_soft_placement=False)
    if device.startswith("/gpu"):
        config.gpu_options.force_gpu_compatible = True
        config.gpu_options.allow_growth = True
    return config


@dataclasses.dataclass
class FeedGraph:
    """Placeholders and ops of the feeding path and train step, in their own ``tf.Graph``.

    Queue components: images, labels, producer index (int32), sequence number (int64), so every
    trained batch can be traced back to the message that carried it.
    """

    graph: tf.Graph
    device: str
    images_in: tf.Tensor
    labels_in: tf.Tensor
    producer_in: tf.Tensor
    seq_in: tf.Tensor
    enqueue: tf.Operation
    close_queue: tf.Operation
    queue_size: tf.Tensor
    put: tf.Operation
    staged_size: tf.Tensor
    step: tf.Operation  # train op grouped with the next put
    loss: tf.Tensor
    trained_producer: tf.Tensor
    trained_seq: tf.Tensor
    capacity: int


# (staged images, staged labels, spec) -> (loss, op): what one step does with a staged batch.
StepBuilder = Callable[[tf.Tensor, tf.Tensor, BatchSpec], tuple[tf.Tensor, tf.Operation]]


def alexnet_step(
    images: tf.Tensor, labels: tf.Tensor, spec: BatchSpec
) -> tuple[tf.Tensor, tf.Operation]:
    """The default step: the seed's AlexNet trained on the staged batch (uint8 cast on device)."""
    return model.train_op(model.to_float_images(images), labels, spec.num_classes)


def build(
    spec: BatchSpec,
    queue_capacity: int,
    stage_depth: int,
    device: str,
    step_builder: StepBuilder = alexnet_step,
) -> FeedGraph:
    """Build the feeding path and a step. ``device`` is ``/cpu:0`` or ``/gpu:0``.

    ``step_builder`` replaces the train op (``bench ingest`` uses a trivial consumer).
    """
    model.check_image_size(spec.height, spec.width)
    graph = tf.Graph()
    image_dtype = tf.as_dtype(spec.image_dtype)
    dtypes = [image_dtype, tf.int32, tf.int32, tf.int64]
    shapes = [spec.image_shape, spec.label_shape, [], []]
    with graph.as_default():
        with tf.device("/cpu:0"):
            images_in = v1.placeholder(image_dtype, spec.image_shape, name="images")
            labels_in = v1.placeholder(tf.int32, spec.label_shape, name="labels")
            producer_in = v1.placeholder(tf.int32, [], name="producer")
            seq_in = v1.placeholder(tf.int64, [], name="seq")
            queued_images = images_in
            if device.startswith("/gpu"):
                # A received frame is fed as pageable memory; one copy on the receive thread
                # moves it into pinned memory (force_gpu_compatible), off the training path.
                queued_images = tf.raw_ops.DeepCopy(x=images_in)
            queue = tf.queue.FIFOQueue(queue_capacity, dtypes, shapes=shapes, name="batches")
            enqueue = queue.enqueue([queued_images, labels_in, producer_in, seq_in])
            close_queue = queue.close(cancel_pending_enqueues=True)
            queue_size = queue.size()
            dequeued = queue.dequeue()
        with tf.device(device):
            staging = StagingArea(dtypes, shapes=shapes, capacity=stage_depth)
            put = staging.put(dequeued)
            staged_size = staging.size()
            images, labels, producer, seq = staging.get()
            loss, train = step_builder(images, labels, spec)
            step = tf.group(train, put, name="step")
    log.info(
        "graph on %s: FIFOQueue of %d batches (%.0f MiB), staging depth %d, %s images",
        device,
        queue_capacity,
        queue_capacity * spec.batch_bytes / 2**20,
        stage_depth,
        spec.image_dtype,
    )
    return FeedGraph(
        graph=graph,
        device=device,
        images_in=images_in,
        labels_in=labels_in,
        producer_in=producer_in,
        seq_in=seq_in,
        enqueue=enqueue,
        close_queue=close_queue,
        queue_size=queue_size,
        put=put,
        staged_size=staged_size,
        step=step,
        loss=loss,
        trained_producer=producer,
        trained_seq=seq,
        capacity=queue_capacity,
    )
