"""``PassGate``: a ``ServedFeed`` dataset's iterator that ends at a pass boundary, so that
``fit(epochs=E)`` without ``steps_per_epoch`` trains one pass an epoch (docs/tf2.md, "Epochs
that are passes").

Keras 3 makes a new iterator for each epoch when ``fit`` is given no ``steps_per_epoch``, and
drops the old one with what it had prefetched. Ending an epoch at a pass boundary loses no batch
only if the old iterator took nothing of the next pass: the gate is the dataset's
``take_while`` predicate, asked before every dequeue (prefetching included), and says:

- True once a batch is in the queue for this dequeue (``taken`` counts the dequeues it let
  through: the queue has one consumer, so ``enqueued > taken`` means one is there); it waits
  for one, without a TensorFlow op blocked on the queue;
- False once the queue is closed and every batch was taken (the data's end, as before);
- False, while ``cut`` is on (``FeedCallback``: a ``fit`` without ``steps_per_epoch``), to the
  iterator that took batches of the pass that ends at ``taken`` (``boundaries()``: the pass
  books' batch counts where each pass ended, all of it enqueued); a newer iterator (a higher
  generation: the next epoch's) goes on into the next pass;
- False to an iterator older than the newest that took a batch (dropped by Keras: it would
  take a batch nobody trains).

Why that is exact: no batch of pass ``k + 1`` exists before the intake has booked where pass
``k`` ends (``PassBooks.advance``, then ``next_pass``). The gate reads ``enqueued`` first and
the boundaries after it, so a batch of the next pass that it sees in the queue comes with its
boundary. Thread-safe (tf.data calls it from its threads); ``close`` wakes the waiters.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from stagefeed.consumer.tf2.eager_queue import EagerQueueFeed

log = logging.getLogger(__name__)

WAIT_S = 0.05  # a waiting gate looks at the boundaries again this often


class PassGate:
    """The predicate of one feed's dataset (see the module docstring)."""

    def __init__(self, queue: EagerQueueFeed, boundaries: Callable[[], list[int]]) -> None:
        self.queue = queue
        self.boundaries = boundaries
        self.cut = False  # end an iterator at a pass boundary (fit's epochs are passes)
        self._lock = threading.Lock()
        self._taken = 0
        self._last_generation = -1  # the newest iterator that took a batch

    def more(self, generation: tf.Tensor) -> tf.Tensor:
        """(Dataset function) whether this iterator's next dequeue may go on."""
        go_on = tf.numpy_function(self._decide, [generation], tf.bool, stateful=True)
        return tf.reshape(go_on, [])

    def _decide(self, generation: np.ndarray) -> np.bool_:
        generation = int(generation)
        while True:
            enqueued = self.queue.wait_for_more(self._taken, WAIT_S)
            with self._lock:
                if generation < self._last_generation:  # a newer iterator took over
                    return np.bool_(False)
                if (
                    self.cut
                    and generation == self._last_generation
                    and (self._taken in self.boundaries())
                ):
                    log.debug("iterator %d ends at the pass boundary after batch %d",
                              generation, self._taken)  # fmt: skip
                    return np.bool_(False)
                if enqueued > self._taken:
                    self._taken += 1
                    self._last_generation = max(self._last_generation, generation)
                    return np.bool_(True)
                if self.queue.closed and self.queue.enqueued <= self._taken:
                    return np.bool_(False)
