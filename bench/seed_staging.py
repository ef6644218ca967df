"""The seed's own design, reproduced: Python thread -> FIFOQueue (CPU) -> StagingArea -> step.

Faithful to the posted code: placeholders of shape ``[None, H, W, C]`` feed an un-shaped
FIFOQueue (106 deep in the seed; here at most ``queue_mb`` worth, the same bound the stagefeed
mode gets), the dequeued tensors get their shapes back with ``set_shape``, an unbounded
StagingArea sits on the device, its ``put`` is grouped with the train op, the queue is filled
before timing and ``seed_prestage`` batches (the seed's single ``sess.run(put_op)``: 1) are
staged before the first step. With 0, ``get()`` waits for the same step's ``put()``
(tensorflow#12061). One Python thread keeps enqueuing the same numpy batch, as the question
describes; on a GPU the batch stays in pageable memory (no ``force_gpu_compatible``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import tensorflow as tf
from tensorflow.python.ops.data_flow_ops import StagingArea

from stagefeed.bench.batches import host_batch
from stagefeed.bench.cpu import threads_cpu_s
from stagefeed.bench.modes import GraphMode, alexnet_step, alignment, tf_dtype
from stagefeed.common.errors import BrokenError
from stagefeed.common.lifecycle import join_threads

log = logging.getLogger(__name__)
v1 = tf.compat.v1

FILL_TIMEOUT_S = 300.0
POLL_S = 0.02
JOIN_TIMEOUT_S = 5.0


class SeedStagingMode(GraphMode):
    """Invariant: only ``_feeder`` (one thread, "bench-seed-feeder") runs the enqueue op."""

    name = "seed-staging"

    def __init__(self, config, device: str) -> None:
        super().__init__(config, device)
        self._stop = threading.Event()
        self._feeder: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.capacity = config.queue_capacity

    def build(self) -> dict[str, Any]:
        schema = self.schema
        batch = host_batch(schema)
        self._images, self._labels = batch["images"], batch["labels"]
        image_dtype = tf_dtype(schema, "images")
        image_shape = schema.batch_shape(schema["images"])
        label_shape = schema.batch_shape(schema["labels"])
        unknown_batch = [None, *schema["images"].shape]
        with tf.device("/cpu:0"):
            self._images_in = v1.placeholder(image_dtype, unknown_batch)
            self._labels_in = v1.placeholder(tf.int32, [None])
            queue = tf.queue.FIFOQueue(self.capacity, dtypes=[image_dtype, tf.int32])
            self._enqueue = queue.enqueue([self._images_in, self._labels_in])
            self._close_queue = queue.close(cancel_pending_enqueues=True)
            self._size = queue.size()
            images, labels = queue.dequeue()
            images.set_shape(image_shape)
            labels.set_shape(label_shape)
        with tf.device(self.device):
            stage = StagingArea(dtypes=[image_dtype, tf.int32], shapes=None)
            self._put = stage.put([images, labels])
            images, labels = stage.get()
            images.set_shape(image_shape)
            labels.set_shape(label_shape)
            _, train = alexnet_step(images, labels, schema)
            self._fetch = tf.group(train, self._put)
        return {
            "queue_capacity": self.capacity,
            "prestaged": self.config.seed_prestage,
            "host_batch_align64": alignment(self._images),
            "feeder_threads": 1,
        }

    def after_init(self) -> None:
        self._feeder = threading.Thread(target=self._feed_loop, name="bench-seed-feeder")
        self._feeder.start()
        if not self._wait_full(FILL_TIMEOUT_S):
            raise BrokenError(f"the seed's queue did not fill within {FILL_TIMEOUT_S:.0f} s")
        for _ in range(self.config.seed_prestage):
            self.session.run(self._put)

    def feed_cpu_s(self) -> float | None:
        """CPU seconds so far of the feeder thread (numpy -> TF copy and enqueue)."""
        return threads_cpu_s(("bench-seed-feeder",))

    def settle(self) -> dict[str, Any]:
        started = time.monotonic()
        full = self._wait_full(60.0)
        return {"queue_full": full, "settle_s": round(time.monotonic() - started, 3)}

    def close(self) -> None:
        self._stop.set()
        if self.session is not None:
            try:
                self.session.run(self._close_queue)
            except tf.errors.OpError as exc:
                log.warning("closing the seed's queue failed: %s", exc)
        if self._feeder is not None:
            join_threads([self._feeder], JOIN_TIMEOUT_S)
        super().close()

    def _feed_loop(self) -> None:
        feed = {self._images_in: self._images, self._labels_in: self._labels}
        try:
            while not self._stop.is_set():
                self.session.run(self._enqueue, feed)
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError):
            return  # the queue was closed: the mode is shutting down
        except Exception as exc:  # noqa: BLE001 - reported by _wait_full, never swallowed
            log.exception("seed feeder thread failed")
            self._failure = exc

    def _wait_full(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.session.run(self._size) < self.capacity:
            if self._failure is not None:
                raise BrokenError(f"seed feeder failed: {self._failure!r}") from self._failure
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True
