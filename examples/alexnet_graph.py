"""(c) The seed's AlexNet in graph mode, fed by a real producer process, saved and restored.

The design card's path: producer process -> ZeroMQ -> FIFOQueue on the CPU -> StagingArea on
the training device (primed ``stage_depth`` batches ahead) -> the seed's AlexNet ``model_fn``
(the default ``--model alexnet``). Images are uint8 on the wire, cast to float32 and scaled on
the device; 195x195 is the smallest size AlexNet's VALID convolutions take, batches of 2 keep
it to seconds on a CPU. The session is the user's between ``start()`` and ``close()``: here
it reads a kernel after training, and ``save_dir`` makes ``train`` write ``model.ckpt``
(a ``tf.compat.v1.train.Saver`` checkpoint), which is restored and compared.

    python -m examples.alexnet_graph [DIRECTORY]

The same run from the command line::

    stagefeed run --dtype uint8 --image-size 195 --num-classes 10 --batch-size 2 \\
        --producers 1 --steps 6 --save DIRECTORY
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import numpy as np
import tensorflow as tf

from examples import run_in_directory
from stagefeed import (
    ProducerOptions,
    Producers,
    StepRecord,
    Trainer,
    TrainerOptions,
    image_schema,
)

log = logging.getLogger(__name__)

SCHEMA = image_schema(batch_size=2, image_size=195, dtype="uint8", num_classes=10)
KERNEL = "alexnet/conv1/kernel"


@dataclasses.dataclass
class Trained:
    losses: list[float]
    books: dict[str, dict]  # the ledger's summary, per producer connection
    checkpoint: str  # prefix of the saved variables
    restored_equal: bool  # the checkpoint's conv1 kernel is the trained session's


class Losses:
    """A step observer: the trainer tells it of every step (``StepRecord``) on its loop."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_step(self, record: StepRecord) -> None:
        self.values.append(record.loss)


def train(directory: str, steps: int = 6) -> Trained:
    """Train ``steps`` timed steps (+1 warm-up) on synthetic batches from one producer process."""
    options = TrainerOptions(
        bind="tcp://127.0.0.1:*", schema=SCHEMA, steps=steps, warmup_steps=1, queue_mb=4,
        save_dir=directory,
    )  # fmt: skip
    losses = Losses()
    with Trainer(options, [losses]) as trainer:
        producers = ProducerOptions(connect=trainer.endpoint, workers=1)  # adopts SCHEMA
        with Producers(producers) as running:  # producer processes, as `stagefeed produce`
            trainer.train(threading.Event(), health_check=running.health_check())
        with trainer.feed.graph.as_default():
            (kernel,) = [v for v in tf.compat.v1.global_variables() if v.op.name == KERNEL]
        trained_kernel = trainer.session.run(kernel)
        books = trainer.ledger.summary()
    checkpoint = os.path.join(directory, "model.ckpt")
    restored = tf.train.load_checkpoint(checkpoint).get_tensor(KERNEL)
    return Trained(
        losses.values, books, checkpoint, bool(np.array_equal(restored, trained_kernel))
    )


def main() -> None:
    result = run_in_directory(train)
    log.info("loss by step: %s", [round(v, 2) for v in result.losses])
    for name, books in result.books.items():
        log.info("%s: received %d, trained %d", name, books["received"], books["trained"])
    log.info("%s restored: conv1 kernel equal %s", result.checkpoint, result.restored_equal)


if __name__ == "__main__":
    main()
