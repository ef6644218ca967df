"""One worker of ``bench cluster``'s synthetic peer: the cluster's own loop on device data.

``python -m stagefeed.bench.cluster_worker '{"batch_size": 16, ...}'`` with ``TF_CONFIG`` set:
the same Keras AlexNet (``bench.keras_model``) and the same distributed step and stop vote as
``stagefeed train`` in a cluster (``consumer.cluster``), but each worker's batches are one
batch made on the device once and repeated: no producer, no queue, no copy. What is left is
the step and the cluster's collectives, the floor a fed cluster can reach. Prints one line,
``RESULT {"step_s": [...]}``: every step's wall time, in order.
"""

from __future__ import annotations

import json
import sys
import time

from stagefeed.common.schema import image_schema


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    schema = image_schema(
        batch_size=config["batch_size"], image_size=config["image_size"], dtype="float32"
    )
    from stagefeed.common.tf_config import place
    from stagefeed.consumer.cluster.strategy import make_cluster

    cluster = make_cluster(place())  # the process's first TensorFlow op
    import tensorflow as tf

    from stagefeed.bench.keras_model import alexnet
    from stagefeed.consumer.cluster import loop
    from stagefeed.consumer.cluster.collective_stop import distribute

    with cluster.strategy.scope():
        model = alexnet(schema)
    images, labels = schema["images"], schema["labels"]

    def device_batches(_context: tf.distribute.InputContext) -> tf.data.Dataset:
        x = tf.random.uniform(schema.batch_shape(images), dtype=tf.float32)
        y = tf.random.uniform(schema.batch_shape(labels), 0, labels.bounds[1], dtype=tf.int32)
        return tf.data.Dataset.from_tensors((x, tf.cast(y, labels.np_dtype))).repeat()

    dataset = distribute(
        cluster.strategy,
        device_batches,
        tf.distribute.InputOptions(experimental_fetch_to_device=True),
    )
    times: list[float] = []
    last = [time.monotonic()]

    def after_step(_step: int, _figures: dict[str, float]) -> None:
        now = time.monotonic()
        times.append(now - last[0])
        last[0] = now

    loop.train(cluster.strategy, model, iter(dataset), steps=config["steps"],
               after_step=after_step)  # fmt: skip
    print("RESULT " + json.dumps({"step_s": times}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
