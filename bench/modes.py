"""The graph-only input modes of ``bench steps``: one class per way of handing AlexNet a batch.

Every mode trains ``alexnet_step`` (``consumer.graph.alexnet.model_fn``, the seed's AlexNet, on the
batch
cast on the device by ``consumer.cast.cast_arrays`` as the schema says: uint8 images to
float32 / 255) on the same schema. A mode's lifecycle: ``setup()`` -> ``step()`` ... with
``settle()`` after each block of steps -> ``close()``. ``step()`` returns
``(step seconds, input-wait seconds or None)``: only a mode that waits for its input outside
``session.run`` can say how long it waited. Numpy batches are generated once, in ``setup()``,
so no mode times the RNG.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import tensorflow as tf

from stagefeed.bench.batches import host_batch
from stagefeed.bench.config import StepsConfig
from stagefeed.common.schema import Schema
from stagefeed.consumer.cast import cast_arrays
from stagefeed.consumer.devices import is_gpu
from stagefeed.consumer.graph import alexnet

v1 = tf.compat.v1

# The tf.data mode's prefetch depth, and the pause after a block that lets its buffer refill
# before another mode is timed (tf.data exposes no fill level to wait for).
TF_DATA_PREFETCH = 2
TF_DATA_SETTLE_S = 0.5


def alexnet_step(
    images: tf.Tensor, labels: tf.Tensor, schema: Schema
) -> tuple[tf.Tensor, tf.Operation]:
    """(loss, train op): the trainer's own step on a batch as it arrives (call under the
    training device): the schema's cast and scale, then ``consumer.graph.alexnet.model_fn``."""
    staged = cast_arrays(schema, {"images": images, "labels": labels})
    return alexnet.model_fn(staged, schema)


def tf_dtype(schema: Schema, name: str) -> tf.DType:
    return tf.as_dtype(schema[name].np_dtype)


def alignment(array: np.ndarray) -> int:
    """Data address mod 64: TensorFlow aliases a fed array only when this is 0."""
    return int(array.ctypes.data % 64)


def plain_session_config(device: str) -> v1.ConfigProto:
    """The seed's session: TF defaults (no forced pinned memory); GPU memory grown on demand."""
    config = v1.ConfigProto(allow_soft_placement=False)
    if is_gpu(device):
        config.gpu_options.allow_growth = True
    return config


def generator_dataset(schema: Schema, device: str) -> tuple[tf.data.Dataset, dict[str, Any]]:
    """``Dataset.from_generator`` yielding one numpy ``(images, labels)`` batch (made once)
    forever, ``prefetch(TF_DATA_PREFETCH)``, and ``prefetch_to_device`` last on a GPU (it
    must be the final transformation); with info for the report. Graph or eager alike."""
    batch = host_batch(schema)
    pair = (batch["images"], batch["labels"])

    def generate():
        while True:
            yield pair

    signature = tuple(
        tf.TensorSpec(schema.batch_shape(schema[name]), tf_dtype(schema, name))
        for name in ("images", "labels")
    )
    on_gpu = is_gpu(device)
    with tf.device("/cpu:0"):
        dataset = tf.data.Dataset.from_generator(generate, output_signature=signature)
        dataset = dataset.prefetch(TF_DATA_PREFETCH)
    if on_gpu:
        dataset = dataset.apply(tf.data.experimental.prefetch_to_device(device))
    info = {
        "prefetch": TF_DATA_PREFETCH,
        "prefetch_to_device": on_gpu,
        "host_batch_align64": alignment(pair[0]),
    }
    return dataset, info


class GraphMode:
    """A mode whose whole input path lives in one graph; a step is one ``session.run``."""

    name = ""

    def __init__(self, config: StepsConfig, device: str) -> None:
        self.config = config
        self.schema = config.schema
        self.device = device
        self.session: Any = None
        self._fetch: Any = None
        self._feed: dict | None = None

    def build(self) -> dict[str, Any]:
        """Add the input path and step to the default graph; set ``_fetch``; return info."""
        raise NotImplementedError

    def after_init(self) -> None:
        """Hook run once the variables are initialized (queue filling, pre-staging)."""

    def setup(self) -> dict[str, Any]:
        graph = tf.Graph()
        with graph.as_default():
            info = self.build()
            init = [v1.global_variables_initializer(), v1.local_variables_initializer()]
        self.session = v1.Session(graph=graph, config=plain_session_config(self.device))
        self.session.run(init)
        self.after_init()
        return info

    def step(self) -> tuple[float, float | None]:
        started = time.perf_counter()
        self.session.run(self._fetch, self._feed)
        return time.perf_counter() - started, None

    def settle(self) -> dict[str, Any]:
        """Let background work of the last block finish before another mode is timed."""
        return {}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


class SyntheticMode(GraphMode):
    """The seed's ``input_pipeline``: random images made by TF ops, held in a local variable.

    ``on_host=False`` keeps them on the training device (the seed's upper bound);
    ``on_host=True`` keeps them on the CPU, so on a GPU every step copies them over.
    Labels are drawn per step by ``random_uniform``, as the seed did.
    """

    def __init__(self, config: StepsConfig, device: str, on_host: bool) -> None:
        super().__init__(config, device)
        self.on_host = on_host
        self.name = "synthetic-host" if on_host else "synthetic-device"

    def build(self) -> dict[str, Any]:
        schema = self.schema
        image_shape = schema.batch_shape(schema["images"])
        num_classes = schema["labels"].bounds[1]
        data_device = "/cpu:0" if self.on_host else self.device
        with tf.device(data_device):
            if schema["images"].dtype == "uint8":
                initial = tf.cast(tf.random.uniform(image_shape, 0, 256, dtype=tf.int32), tf.uint8)
            else:
                initial = v1.truncated_normal(image_shape, mean=127.0, stddev=60.0)
            images = v1.Variable(
                initial,
                trainable=False,
                collections=[v1.GraphKeys.LOCAL_VARIABLES],
                name="synthetic_images",
            )
            labels = tf.random.uniform(
                schema.batch_shape(schema["labels"]),
                0,
                num_classes,
                dtype=tf.int32,
                name="synthetic_labels",
            )
        with tf.device(self.device):
            _, self._fetch = alexnet_step(tf.identity(images), labels, schema)
        copies = self.on_host and not self.device.startswith("/cpu")
        return {
            "data_device": data_device,
            "copied_per_step": copies,
            "note": "" if copies or not self.on_host else "CPU-only: same as synthetic-device",
        }


class FeedDictMode(GraphMode):
    """The seed's third row: one numpy batch fed through placeholders at every step."""

    name = "feed_dict"

    def build(self) -> dict[str, Any]:
        schema = self.schema
        batch = host_batch(schema)
        with tf.device("/cpu:0"):
            inputs = {
                name: v1.placeholder(tf_dtype(schema, name), schema.batch_shape(schema[name]))
                for name in ("images", "labels")
            }
        with tf.device(self.device):
            _, self._fetch = alexnet_step(inputs["images"], inputs["labels"], schema)
        self._feed = {inputs[name]: batch[name] for name in inputs}
        return {"host_batch_align64": alignment(batch["images"])}


class TfDataMode(GraphMode):
    """What a TF user would pick: ``Dataset.from_generator`` over numpy batches + ``prefetch``.

    On a GPU, ``prefetch_to_device`` is applied last (it must be the final transformation).
    """

    name = "tf.data"

    def build(self) -> dict[str, Any]:
        dataset, info = generator_dataset(self.schema, self.device)
        images, labels = v1.data.make_one_shot_iterator(dataset).get_next()
        with tf.device(self.device):
            _, self._fetch = alexnet_step(images, labels, self.schema)
        return info

    def settle(self) -> dict[str, Any]:
        time.sleep(TF_DATA_SETTLE_S)
        return {"slept_s": TF_DATA_SETTLE_S}
