"""The TF 2 feed's queue: an eagerly created FIFOQueue on the host, filled from Python threads.

Components, in order: the schema's arrays (wire dtypes, full batch shapes from
``schema.wire()``), then ``peer`` (int32, which connection sent the batch) and ``seq`` (int64,
its sequence number on that connection), so every trained batch can be traced to its message.

Cost of an enqueue: eager conversion of a numpy array to a tensor copies it once (memcpy under
the GIL: ~20 ms for a 39.6 MB uint8 batch on the 2-core CI machine class, aligned or not). A
received ZeroMQ frame is not 64-byte aligned, so a copy is unavoidable anyway, and DLPack must
never be handed such memory (the next op aborts the process). The queue then owns the copy: the
caller may reuse or release its buffers as soon as ``enqueue`` returns.

Lifecycle: ``EagerQueueFeed(...)`` -> ``enqueue`` from any number of threads -> ``close()``
(idempotent). After ``close`` every pending and later ``enqueue`` returns False; batches already
queued stay and are still dequeued, after which the queue reads as ended.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from stagefeed.common.errors import ConfigError
from stagefeed.common.options import MIB
from stagefeed.common.schema import Schema, SchemaMismatch
from stagefeed.consumer.devices import HOST, training_device
from stagefeed.consumer.queue_element import queue_element

log = logging.getLogger(__name__)

class EagerQueueFeed:
    """A ``tf.queue.FIFOQueue`` of whole batches on the host CPU, ``capacity`` batches deep.

    Invariants: ``enqueued`` counts exactly the batches that entered the queue; ``enqueue``
    never raises TensorFlow's Cancelled/OutOfRange errors (it returns False once closed);
    ``close`` may be called any number of times, from any thread.
    """

    def __init__(self, schema: Schema, capacity: int, device: str = "auto") -> None:
        if not isinstance(schema, Schema):
            raise ConfigError(f"schema must be a Schema, got {type(schema).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"queue capacity must be a positive number of batches, got {capacity!r}"
            )
        if not tf.executing_eagerly():
            # Creating a queue inside tf.function raises NotFoundError (tensorflow#39820).
            raise ConfigError("EagerQueueFeed must be created eagerly, not inside tf.function")
        self.schema = schema
        self.capacity = capacity
        self.device = training_device(device)
        dtypes, shapes = queue_element(schema)
        with tf.device(HOST):
            self.queue = tf.queue.FIFOQueue(
                capacity, dtypes, shapes=shapes, name="stagefeed_batches"
            )
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)  # an enqueue or the close happened
        self._enqueued = 0
        self._closed = False
        log.info(
            "feed queue on %s: %d batches of %s (%.1f MiB), training device %s",
            HOST,
            capacity,
            schema.describe(),
            capacity * schema.batch_bytes / MIB,
            self.device,
        )

    def enqueue(self, arrays: Mapping[str, np.ndarray], peer: int, seq: int) -> bool:
        """Put one batch; block while the queue is full (the GIL is released while blocked).

        Returns True once the batch is queued, False if the feed was closed before or while
        waiting. Raises ``SchemaMismatch`` if names, dtypes or shapes differ from the schema
        (bounds are the receive path's check, not repeated here).
        """
        if self._closed:
            return False
        components = self._components(arrays)
        try:
            self.queue.enqueue([*components, np.int32(peer), np.int64(seq)])
        except (tf.errors.CancelledError, tf.errors.OutOfRangeError):
            return False
        with self._lock:
            self._enqueued += 1
            self._more.notify_all()
        return True

    def wait_for_more(self, than: int, timeout: float) -> int:
        """Wait until more than ``than`` batches entered the queue, it is closed, or
        ``timeout`` passed; the batches that entered it."""
        with self._more:
            self._more.wait_for(lambda: self._enqueued > than or self._closed, timeout)
            return self._enqueued

    def _components(self, arrays: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if not isinstance(arrays, Mapping) or set(arrays) != set(self.schema.names):
            got = sorted(map(str, arrays)) if isinstance(arrays, Mapping) else type(arrays).__name__
            raise SchemaMismatch(f"batch has arrays {got}, expected {list(self.schema.names)}")
        out = []
        for name, dtype, shape in self.schema.wire():
            array = arrays[name]
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
                what = (
                    f"{array.dtype}{list(array.shape)}"
                    if isinstance(array, np.ndarray)
                    else type(array).__name__
                )
                raise SchemaMismatch(f"{name} is {what}, expected {dtype.name}{list(shape)}")
            out.append(array)
        return out

    @property
    def enqueued(self) -> int:
        """Batches that entered the queue so far."""
        with self._lock:
            return self._enqueued

    @property
    def closed(self) -> bool:
        return self._closed

    def size(self) -> int:
        """Batches in the queue now (one eager op, a few microseconds)."""
        return int(self.queue.size())

    def close(self) -> None:
        """Idempotent: refuse further batches and cancel blocked enqueues (they return False).

        Queued batches stay; the dataset reading this queue ends once they are dequeued.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._more.notify_all()
        try:
            self.queue.close(cancel_pending_enqueues=True)
        except tf.errors.OpError as exc:
            log.warning("closing the feed queue failed: %s", exc)
        log.info(
            "feed queue closed: %d batches enqueued, %d still queued", self._enqueued, self.size()
        )
